"""The fused decode attention step (`backends/attention/step.py`), the fused key/value step
(`backends/key_value_step.py`) and the fused attention-residual mixes (`backends/residual_mix.py`), switched on, under
tensor parallelism: two CPU processes over gloo, each holding half the heads (the stream the mixes read is whole on
both), run their Triton kernels under the interpreter (`fused_step_worker.py`). Their decode and verification
steps over the static cache equal the same split model's steps without them (fp32, 1e-5) and the single-process
model's (1e-4, as the other tensor-parallel tests: the split sums `o_proj` and the experts in another order)."""

import json
from pathlib import Path

from inkling2_helpers import INTERPRETER_PRELUDE, ORACLE_TEXT_CONFIG, needs_triton, torchrun

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig
from transformers_inkling2.tiny import randomize_

WORKER = Path(__file__).with_name("fused_step_worker.py")


@needs_triton
def test_fused_steps_on_each_ranks_heads_give_the_single_process_steps(tmp_path):
    checkpoint = tmp_path / "model"
    randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**ORACLE_TEXT_CONFIG)), seed=7).save_pretrained(checkpoint)
    report_file = tmp_path / "report.json"
    launcher = tmp_path / "launcher.py"  # each rank: the interpreter's prelude, then the worker beside its helpers
    launcher.write_text(f"{INTERPRETER_PRELUDE}\nimport runpy, sys\nsys.path.insert(0, {str(WORKER.parent)!r})\n"
                        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n")
    torchrun(2, launcher, checkpoint, report_file)
    ranks = json.loads(report_file.read_text())
    heads = ORACLE_TEXT_CONFIG["num_attention_heads"]
    layers = ORACLE_TEXT_CONFIG["num_hidden_layers"]
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["local_heads"] == heads // 2
        # every decode and verification step of every layer
        assert rank["fused_calls"] == rank["key_value_calls"] == layers * 5
        # the attention inputs of every layer but the first and the readout; every layer's MoE input and end
        assert rank["mix_calls"] == [layers * 5] * 3
        assert rank["to_plain_split"] <= 1e-5
        assert rank["to_single_process"] <= 1e-4 and rank["plain_split_to_single_process"] <= 1e-4
