"""The markers that transformers' fetched suites put on their tests (transformers registers them in its own
conftest, which the sdist does not ship), registered so that pytest does not warn about each one."""

SUITE_MARKERS = (
    "accelerate_tests",
    "flash_attn_3_test",
    "flash_attn_4_test",
    "flash_attn_test",
    "is_agent_test",
    "is_expert_parallel_test",
    "is_fsdp_test",
    "is_pipeline_test",
    "is_staging_test",
    "is_tensor_parallel_test",
    "is_training_test",
    "order",
    "slow",
    "torch_compile_test",
)


def pytest_configure(config):
    for marker in SUITE_MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' common test suites")
