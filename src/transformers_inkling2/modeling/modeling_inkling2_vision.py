"""The ViT of Inkling-2-Small and the merger that turns its patches into text-width image tokens.

Data path, for a batch of images packed into one sequence:

1. `pixel_values` holds one `40 x 40 x 3` block per *text* image token (the image processor's layout). Each block
   is a 2x2 square of 20x20 patches; a linear layer embeds every patch.
2. A learned 32x32 position grid is bilinearly resampled to each image's patch grid and added.
3. Every image gets its own class token in front of its patches; a LayerNorm follows.
4. 23 pre-norm encoder layers with layer scales. Attention uses an axial rotary embedding (patch row and column,
   the class token at (0, 0)) and stays inside each image: images packed together never see each other.
5. The merger concatenates the four patches of each 2x2 square and projects them with an MLP into the text model's
   width: one row of `pooler_output` per image placeholder token, in the text's order.

Parameter names match transformers' built-in `Inkling2VisionModel`, so state dicts move between the two unchanged;
`vision_checkpoint_renames()` maps the original checkpoint layout onto them.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.output_capturing import capture_outputs

from ..configuration_inkling2 import Inkling2VisionConfig


def vision_checkpoint_renames() -> list[tuple[str, str]]:
    """(regex source, target) pairs from the original checkpoint's vision keys to ours.

    Each pair renames one family of keys completely, no key matches two pairs in either direction, and keys that
    already have our names match nothing, so the pairs can be applied in any order, more than once, and reversed
    (transformers reverses its renamings to save in the original layout). Sources match anywhere in a key
    (`re.search`), so the `model.` prefix is kept as it is.
    """
    layer = r"visual\.backbone\.layers\.(\d+)\."
    ours = r"vision_tower.layers.\1."
    return [
        # the original position table is a bare tensor; ours is an nn.Embedding
        (
            r"visual\.backbone\.embeddings\.position_embedding(?![\w.])",
            "vision_tower.embeddings.position_embedding.weight",
        ),
        (
            r"visual\.backbone\.embeddings\.(patch_embedding|class_embedding|cls_position_embedding)",
            r"vision_tower.embeddings.\1",
        ),
        (r"visual\.backbone\.ln_pre\.", "vision_tower.pre_layernorm."),
        (layer + r"ln_1\.", ours + "layernorm_before."),
        (layer + r"ln_2\.", ours + "layernorm_after."),
        (layer + r"mlp\.c_fc\.", ours + "mlp.fc1."),
        (layer + r"mlp\.c_proj\.", ours + "mlp.fc2."),
        (layer + r"ls_1\.gamma", ours + "lambda_1"),
        (layer + r"ls_2\.gamma", ours + "lambda_2"),
        (layer + r"self_attn\.", ours + "self_attn."),
        (r"visual\.proj_in\.", "vision_tower.merger.linear_1."),
        (r"visual\.proj_out\.", "vision_tower.merger.linear_2."),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Geometry: where every patch sits, and how the learned position grid is resampled to it
# ----------------------------------------------------------------------------------------------------------------


def patch_coordinates(token_rows: int, token_cols: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of one image, in the order the ViT sees them.

    Patches come token by token (tokens in raster order), and inside a token its `merge x merge` patches in raster
    order, so the merger later finds the patches of one text token next to each other.
    """
    rows = torch.arange(token_rows * merge, device=device).view(token_rows, 1, merge, 1)
    cols = torch.arange(token_cols * merge, device=device).view(1, token_cols, 1, merge)
    shape = (token_rows, token_cols, merge, merge)
    return rows.expand(shape).flatten(), cols.expand(shape).flatten()


def bilinear_taps(positions: torch.Tensor, size: int, grid_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two source rows of a `grid_size`-long table, and their weights, for each position on an axis of `size`.

    Half-pixel centres (`align_corners=False`) and edge clamping, like `F.interpolate(mode="bilinear")`.
    Returns `[n, 2]` long indices and `[n, 2]` float32 weights.
    """
    source = (positions.float() + 0.5) * grid_size / size - 0.5
    lower = source.floor()
    taps = torch.stack([lower, lower + 1], dim=-1)
    weights = 1 - (source[:, None] - taps).abs()  # hat kernel: 1 - distance
    return taps.long().clamp(0, grid_size - 1), weights


def image_runs(token_grids: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(images, token rows, token cols) for each run of consecutive images of one size: the ViT treats a run as one
    batch, so a batch of equal pictures costs the launches of one picture, not of each."""
    return [(len(list(run)), rows, cols) for (rows, cols), run in itertools.groupby(token_grids)]


class Inkling2VisionEmbeddings(nn.Module):
    """Patch embedding + resampled learned positions, with a class token in front of each image."""

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.merge_size = config.spatial_merge_size
        self.grid_size = config.posemb_grid_size
        self.num_channels = config.num_channels
        self.patch_embedding = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding = nn.Embedding(config.posemb_grid_size**2, config.hidden_size)
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.cls_position_embedding = nn.Parameter(torch.zeros(config.hidden_size))

    def patchify(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[tokens, 40, 40, C]` -> `[tokens * 4, 20 * 20 * C]`, patches in `patch_coordinates` order."""
        merge, patch = self.merge_size, self.patch_size
        blocks = pixel_values.reshape(-1, merge, patch, merge, patch, self.num_channels)
        # (token, patch row in token, pixel row, patch col in token, pixel col, C) -> patches in raster order
        return blocks.permute(0, 1, 3, 2, 4, 5).reshape(-1, patch * patch * self.num_channels)

    def position_embeddings(self, token_rows: int, token_cols: int) -> torch.Tensor:
        """The learned `grid x grid` table resampled to one image's patch grid, in float32."""
        merge, grid = self.merge_size, self.grid_size
        device = self.position_embedding.weight.device
        rows, cols = patch_coordinates(token_rows, token_cols, merge, device=device)
        row_taps, row_weights = bilinear_taps(rows, token_rows * merge, grid)
        col_taps, col_weights = bilinear_taps(cols, token_cols * merge, grid)
        table = self.position_embedding.weight
        embeddings = 0
        for i in range(2):
            for j in range(2):
                weight = (row_weights[:, i] * col_weights[:, j])[:, None]
                embeddings = embeddings + weight * table[row_taps[:, i] * grid + col_taps[:, j]]
        return embeddings

    def forward(self, pixel_values: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """`runs`: (images, token rows, token cols) per run of equal images (`image_runs`). Returns
        `[sum(1 + 4 * rows * cols), hidden]`: each image's class token, then its patches."""
        dtype = self.patch_embedding.weight.dtype
        patch_embeddings = self.patch_embedding(self.patchify(pixel_values.to(dtype)))
        class_token = (self.class_embedding + self.cls_position_embedding).to(dtype)[None, None]

        pieces, start = [], 0
        for images, token_rows, token_cols in runs:
            patches = token_rows * token_cols * self.merge_size**2
            end = start + images * patches
            positions = self.position_embeddings(token_rows, token_cols).to(dtype)
            run = patch_embeddings[start:end].view(images, patches, -1) + positions
            pieces.append(torch.cat([class_token.expand(images, 1, -1), run], dim=1).flatten(0, 1))
            start = end
        return torch.cat(pieces)


# ----------------------------------------------------------------------------------------------------------------
# Axial rotary embedding
# ----------------------------------------------------------------------------------------------------------------


class Inkling2VisionRotaryEmbedding(nn.Module):
    """Axial RoPE: the first half of each head rotates with the column, the second half with the row.

    Channels rotate in interleaved pairs (0, 1), (2, 3), ...; both axes share the same `head_dim // 4` frequencies.
    The module follows transformers' axial RoPE interface (`rope_type="axial"`, `compute_axial_rope_parameters`,
    the `inv_freq` / `original_inv_freq` buffers that `_init_weights` fills), so tools that read or rescale RoPE find
    it where they look.
    """

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "axial")
        inv_freq, self.attention_scaling = self.compute_axial_rope_parameters(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_axial_rope_parameters(config: Inkling2VisionConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """(the inverse frequencies shared by both axes, `[head_dim // 4]` fp32; the cos/sin scale, always 1)."""
        axis_dim = (config.hidden_size // config.num_attention_heads) // 2
        exponents = torch.arange(0, axis_dim, 2, dtype=torch.float32, device=device) / axis_dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponents), 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids`: `[seq, 2]` (column, row) of each token; `x` only gives the device. Returns float32 cos and
        sin of shape `[seq, head_dim]`."""
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # `model.to(torch.bfloat16)` rounded the buffer: recompute it in fp32
            inv_freq = self.compute_axial_rope_parameters(self.config, device=inv_freq.device)[0]
        inv_freq = inv_freq.to(x.device)
        angles = (position_ids.float()[..., None] * inv_freq).flatten(-2)  # column angles, then row angles
        angles = angles.repeat_interleave(2, dim=-1)  # one angle per interleaved channel pair
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (`[seq, heads, head_dim]`) in float32 and cast back."""
    x32 = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x32 * cos + rotate_pairs(x32) * sin).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Encoder layer
# ----------------------------------------------------------------------------------------------------------------


def eager_vision_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention, `[batch, heads, seq, dim]` in, `[batch, seq, heads, dim]` out; softmax in float32."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class Inkling2VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each image of the packed sequence.

    The backend comes from transformers' `ALL_ATTENTION_FUNCTIONS` registry (`config._attn_implementation`):
    `"sdpa"` (default) or `"eager"` (`eager_vision_attention`, the reference). One call per run of equal-sized
    images (a batch of them) keeps images apart without an O(total^2) block-diagonal mask, and lets SDPA pick its
    fused kernels.
    """

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.num_key_value_groups = 1
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        runs: list[tuple[int, int]],
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """`runs`: (images, tokens per image) for each run of equal-sized images. Returns (output, each image's
        attention probabilities [1, heads, n, n] or None). With `output_attentions` this call runs the eager
        reference, which materializes them."""
        seq = hidden_states.shape[0]
        shape = (seq, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape)
        key = self.k_proj(hidden_states).view(shape)
        value = self.v_proj(hidden_states).view(shape)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

        if output_attentions:
            attention = eager_vision_attention
        else:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_vision_attention)
        dropout = self.config.attention_dropout if self.training else 0.0
        outputs, probabilities, start = [], [], 0
        for images, length in runs:
            end = start + images * length
            # [images * n, heads, dim] -> [images, heads, n, dim]
            q, k, v = (t[start:end].view(images, length, *shape[1:]).transpose(1, 2) for t in (query, key, value))
            out, run_probabilities = attention(self, q, k, v, None, scaling=self.scaling, dropout=dropout, is_causal=False)
            outputs.append(out.reshape(images * length, -1))
            if output_attentions:
                probabilities += run_probabilities.split(1)
            start = end
        return self.out_proj(torch.cat(outputs)), tuple(probabilities) if output_attentions else None


class Inkling2VisionMLP(nn.Module):
    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden_states)))


class Inkling2VisionEncoderLayer(GradientCheckpointingLayer):
    """Pre-norm block whose attention and MLP outputs are scaled per channel (`lambda_1`, `lambda_2`)."""

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        self.layernorm_before = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Inkling2VisionAttention(config)
        self.layernorm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Inkling2VisionMLP(config)
        self.lambda_1 = nn.Parameter(torch.full((config.hidden_size,), config.layer_scale_init_value))
        self.lambda_2 = nn.Parameter(torch.full((config.hidden_size,), config.layer_scale_init_value))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        runs: list[tuple[int, int]],
        output_attentions: bool = False,
    ) -> torch.Tensor:
        normed = self.layernorm_before(hidden_states)
        attended, _ = self.self_attn(normed, position_embeddings, runs, output_attentions)
        hidden_states = hidden_states + self.lambda_1 * attended
        return hidden_states + self.lambda_2 * self.mlp(self.layernorm_after(hidden_states))


class Inkling2VisionMerger(nn.Module):
    """MLP from four concatenated patches (one text token's 2x2 square) to the text model's width."""

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__()
        in_features = config.spatial_merge_size**2 * config.hidden_size
        self.linear_1 = nn.Linear(in_features, config.projection_hidden_dim, bias=config.projector_bias)
        self.act = ACT2FN[config.hidden_act]
        self.linear_2 = nn.Linear(config.projection_hidden_dim, config.text_hidden_size, bias=config.projector_bias)

    def forward(self, merged_patches: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(merged_patches)))


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class Inkling2VisionPreTrainedModel(PreTrainedModel):
    config_class = Inkling2VisionConfig
    config: Inkling2VisionConfig
    base_model_prefix = "model"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["Inkling2VisionEncoderLayer"]
    _supports_sdpa = True
    # what transformers' `capture_outputs` records: each layer's output, each attention's per-image probabilities
    _can_record_outputs = {"hidden_states": Inkling2VisionEncoderLayer, "attentions": Inkling2VisionAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        """Linear, Embedding and LayerNorm come from transformers; these are the parameters it does not know."""
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Inkling2VisionEmbeddings):
            init.normal_(module.class_embedding, mean=0.0, std=std)
            init.normal_(module.cls_position_embedding, mean=0.0, std=std)
        elif isinstance(module, Inkling2VisionEncoderLayer):
            init.constant_(module.lambda_1, self.config.layer_scale_init_value)
            init.constant_(module.lambda_2, self.config.layer_scale_init_value)


class Inkling2VisionModel(Inkling2VisionPreTrainedModel):
    """The ViT and its merger: `pixel_values` + `image_grid_thw` in, one text-width vector per image token out."""

    def __init__(self, config: Inkling2VisionConfig):
        super().__init__(config)
        self.embeddings = Inkling2VisionEmbeddings(config)
        self.pre_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = Inkling2VisionRotaryEmbedding(config)
        self.layers = nn.ModuleList([Inkling2VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.merger = Inkling2VisionMerger(config)
        self.post_init()

    def token_grids(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[tuple[int, int]]:
        """Check that the inputs describe each other; return (token rows, token cols) per image."""
        cell = self.config.patch_size * self.config.spatial_merge_size
        expected = (cell, cell, self.config.num_channels)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"`pixel_values` must have shape [image tokens, {cell}, {cell}, {self.config.num_channels}] (one "
                f"block per image token, channels last, as the Inkling2 image processor returns), got "
                f"{tuple(pixel_values.shape)}."
            )
        grid = torch.as_tensor(image_grid_thw)
        if grid.ndim != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
            raise ValueError(
                f"`image_grid_thw` must be an integer tensor of shape [images, 3], got {tuple(grid.shape)} "
                f"({grid.dtype})."
            )
        if grid.shape[0] == 0:
            raise ValueError("`image_grid_thw` describes no image.")
        sizes = []
        for index, (frames, rows, cols) in enumerate(grid.tolist()):
            if frames != 1 or rows < 1 or cols < 1:
                raise ValueError(
                    f"`image_grid_thw[{index}]` is {[frames, rows, cols]}: Inkling2 encodes still images, so each "
                    f"row must be [1, token rows >= 1, token cols >= 1]."
                )
            sizes.append((rows, cols))
        tokens = sum(rows * cols for rows, cols in sizes)
        if tokens != pixel_values.shape[0]:
            raise ValueError(
                f"`pixel_values` has {pixel_values.shape[0]} rows (one per image token) but `image_grid_thw` "
                f"describes {tokens} image tokens ({sizes}): pass the two outputs of the same processor call."
            )
        return sizes

    @capture_outputs
    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs) -> BaseModelOutputWithPooling:
        r"""
        pixel_values (`torch.Tensor` of shape `(image tokens, 40, 40, 3)`):
            One pixel block per text image token, images one after another, tokens in raster order.
        image_grid_thw (`torch.LongTensor` of shape `(images, 3)`):
            `[1, token rows, token cols]` for each image.

        Returns `last_hidden_state` (`[sum(1 + 4 * rows * cols), hidden]`: each image's class token then its
        patches), `pooler_output` (`[image tokens, text_hidden_size]`, the features that replace the image
        placeholder tokens, in order) and, if asked, `hidden_states` (the input of the first layer and the output
        of every layer) and `attentions` (per layer, each image's probabilities); transformers' `capture_outputs`
        records them and gives the tuple for `return_dict=False`.
        """
        output_attentions = kwargs.get("output_attentions")
        output_attentions = bool(self.config.output_attentions if output_attentions is None else output_attentions)
        runs = image_runs(self.token_grids(pixel_values, image_grid_thw))
        merge = self.config.spatial_merge_size
        lengths = [(images, 1 + rows * cols * merge**2) for images, rows, cols in runs]

        hidden_states = self.pre_layernorm(self.embeddings(pixel_values, runs))

        # rotary positions: class token at (0, 0), patches at (row + 1, col + 1)
        device = hidden_states.device
        zero = torch.zeros(1, dtype=torch.long, device=device)
        positions = []
        for images, rows, cols in runs:
            patch_rows, patch_cols = patch_coordinates(rows, cols, merge, device=device)
            image = torch.stack([torch.cat([zero, patch_cols + 1]), torch.cat([zero, patch_rows + 1])], dim=-1)
            positions.append(image.repeat(images, 1))
        position_embeddings = self.rotary_emb(hidden_states, torch.cat(positions))

        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, lengths, output_attentions=output_attentions)

        # each image's patches, without its class token, in order
        runs_of_tokens = hidden_states.split([images * length for images, length in lengths])
        patches = torch.cat([run.view(images, length, -1)[:, 1:].flatten(0, 1)
                             for run, (images, length) in zip(runs_of_tokens, lengths, strict=True)])  # fmt: skip
        pooler_output = self.merger(patches.reshape(-1, merge**2 * patches.shape[-1]))

        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooler_output)


__all__ = ["Inkling2VisionModel", "Inkling2VisionPreTrainedModel", "vision_checkpoint_renames"]
