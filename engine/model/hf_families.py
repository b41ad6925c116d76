"""The Llama block's transformers families and the architecture options of today's open models under their
names (issue 35): which family computes a run's RMSNorm + SwiGLU model, and which families a [pretrained]
directory may hold.

    rewind option                 transformers                              family
    num_kv_heads, head_dim        num_key_value_heads, head_dim             all
    norm_eps                      rms_norm_eps (q_norm and k_norm's too)    all
    tie_embeddings                tie_word_embeddings (no lm_head tensor)   all
    rope_scaling linear / llama3  rope_parameters {"rope_type": ...}        all
    qkv_bias                      self_attn.{q,k,v}_proj.bias               Qwen2ForCausalLM ("qwen2")
    qk_norm                       self_attn.{q,k}_norm.weight               Qwen3ForCausalLM ("qwen3")

An export writes Qwen2 for qkv_bias, Qwen3 for qk_norm, else Llama. Qwen2 always has the q, k, v biases
(and no o_proj bias); Qwen3's attention_bias would bias o_proj too, so no family computes qkv_bias with
qk_norm. A directory is read when it is a Llama (Llama 1-3.x, SmolLM2), a Mistral (its sliding window
null or at least block_size: then it never cuts a row) or a Qwen 2 / 2.5 / 3, and its config.json says the
run's model (rewind.engine.model.pretrained_llama compares the shared keys, `family_mismatch` these).
"""

from __future__ import annotations

from rewind.engine.model.hf_llama import LLAMA, ROPE_FIELDS, Names
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import head_width, kv_heads

# model_type -> transformers architecture, of the families a [pretrained] directory may hold.
READ = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_BIAS = {"attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")}
_QK_NORM = {
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
}


def written_model_type(arch: ArchitectureSection) -> str:
    """The family an export of a Llama-block model of `arch` is (see the module docstring)."""
    return "qwen2" if arch.qkv_bias else "qwen3" if arch.qk_norm else "llama"


def family_names(model_type: str, arch: ArchitectureSection) -> Names:
    """The names of `model_type`'s (one of READ) tensors for a model of `arch`: its q, k, v rows split at
    the query and key/value heads' widths, the biases and q/k norms it has, and no lm_head when tied."""
    block = dict(LLAMA.block)
    if arch.qkv_bias:
        block.update(_BIAS)
    if arch.qk_norm:
        block.update(_QK_NORM)
    q_rows, kv_rows = arch.num_heads * head_width(arch), kv_heads(arch) * head_width(arch)
    rows = {name: (q_rows, kv_rows, kv_rows) for name in ("attn.qkv.weight", "attn.qkv.bias")}
    outside = dict(LLAMA.outside)
    if arch.tie_embeddings:
        del outside["head.weight"]
    return Names(READ[model_type], block, outside, rows=rows, tied=arch.tie_embeddings)


def family_keys(model_type: str, arch: ArchitectureSection) -> dict[str, object]:
    """The config.json keys of `model_type` (llama, qwen2, qwen3) beyond the shared ones
    (rewind.engine.model.hf_llama.causal_lm_config writes heads, head_dim, rope and tying)."""
    keys: dict[str, object] = {"hidden_act": "silu", "rms_norm_eps": arch.norm_eps}
    if model_type == "llama":
        return {**keys, "attention_bias": False, "mlp_bias": False}
    keys.update({"use_sliding_window": False, "sliding_window": None})
    return keys if model_type == "qwen2" else {**keys, "attention_bias": False}


def family_mismatch(hf: dict, arch: ArchitectureSection, where: str) -> str | None:
    """The first way the family-specific keys of config.json `hf` (model_type one of READ) differ from a
    run of `arch`, as one line naming both sides; None when they agree."""
    model_type = hf.get("model_type")
    name = READ.get(model_type, "")  # type: ignore[arg-type]
    if model_type == "qwen2" and not arch.qkv_bias:
        return f"pretrained: {where} is a {name} (q, k and v with biases), architecture.qkv_bias is False"
    if model_type != "qwen2" and arch.qkv_bias:
        return f"pretrained: {where} is a {name} (q, k and v without biases), architecture.qkv_bias is True"
    if model_type == "qwen3" and not arch.qk_norm:
        return f"pretrained: {where} is a {name} (q_norm, k_norm), architecture.qk_norm is False"
    if model_type != "qwen3" and arch.qk_norm:
        return f"pretrained: {where} is a {name} (no q_norm, k_norm), architecture.qk_norm is True"
    window_on = model_type == "mistral" or hf.get("use_sliding_window") is True
    window = hf.get("sliding_window")
    if window_on and window is not None and not (isinstance(window, int) and window >= arch.block_size):
        return (
            f"pretrained: {where} has sliding_window {window!r}, architecture.block_size is {arch.block_size} "
            "(rewind attends to the whole row: a window of at least block_size, or null, is read)"
        )
    return None


def rope_mismatch(hf_rope: dict, arch: ArchitectureSection) -> tuple[str, object, str, object] | None:
    """The first rope scaling value of config.json (`hf_rope`: its rope_parameters or rope_scaling, {}
    when none) that differs from `arch`'s, as (their key, their value, our field, our value)."""
    theirs = str(hf_rope.get("rope_type", hf_rope.get("type", "default")))
    ours = arch.rope_scaling.type
    if theirs != ("default" if ours == "none" else ours):
        return "rope type", theirs, "architecture.rope_scaling.type", ours
    for field in ROPE_FIELDS.get(ours, ()):
        value = getattr(arch.rope_scaling, field)
        given = hf_rope.get(field)
        if isinstance(given, bool) or not isinstance(given, int | float) or float(given) != float(value):
            return f"rope {field}", given, f"architecture.rope_scaling.{field}", value
    return None
