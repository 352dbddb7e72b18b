"""Tiny random-weight models, built offline, for engine tests and the demo.

The models are useless as language models but run through a real vLLM engine
in seconds on a CPU. Everything is made locally (no hub access): a ByteLevel BPE
tokenizer trained on synthetic text, and randomly initialised weights from a
fixed seed, so every build gives the same files and the same greedy outputs.

Shapes are chosen for vLLM's CPU attention backend, which only supports
head_dim in {32, 64, 80, ...} and block sizes that are multiples of 32.
Weights are stored as float32: with NIXL and vLLM's default bf16 the decode
worker died with SIGILL (``Caught signal 4``) in CPU attention, whose bf16 path
with block sizes that are multiples of 32 uses AMX (the same path worked without
NIXL). float32 selects the "vec" ISA, so tests run in float32.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

DEFAULT_ROOT = Path.home() / ".cache" / "kvtail-connector" / "models"
SEED = 0
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
# Written last: a folder without it is a half-finished build and is redone.
_MARKER = ".kvtail-model.json"
# Bump when what a builder writes changes, so cached folders get rebuilt.
_BUILD_VERSION = 1

# The tiny tokenizer is trained on these words (most end up one token each).
WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "four",
    "cache",
    "block",
    "slot",
    "tail",
    "token",
    "prefill",
    "decode",
    "engine",
    "model",
    "layer",
    "head",
    "key",
    "value",
    "page",
    "memory",
    "transfer",
    "remote",
    "local",
    "write",
    "read",
    "zero",
    "stale",
    "byte",
    "float",
    "attention",
    "mamba",
    "state",
    "load",
    "save",
    "store",
    "hit",
    "miss",
    "request",
    "river",
    "stone",
    "cloud",
    "light",
    "green",
    "blue",
    "red",
    "quick",
    "slow",
    "north",
    "south",
    "east",
    "west",
]


def _synthetic_corpus(n_lines: int = 2000) -> Iterator[str]:
    """Deterministic pseudo-sentences, enough for BPE to learn ~250 merges."""
    rng = random.Random(SEED)
    for i in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        yield f"{' '.join(words).capitalize()} {i % 97}."


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text (and any decoded id) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    fast.save_pretrained(str(out))


def _llama_files(out: Path) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # CPU attention has no kernel for head_dim 16 (= 64 / 4)
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(str(out))
    return {"architecture": "LlamaForCausalLM", "params": model.num_parameters()}


def _granite_hybrid_files(out: Path) -> dict[str, Any]:
    """Granite-4.0-H style hybrid: one Mamba2 layer, then one attention layer.

    Runs on the CPU engine in float32 (vLLM's Mamba2 mixer has CPU kernels in
    layers/mamba/ops/cpu/), so it also works with NIXL. But NOT with prefix
    caching: that forces mamba_cache_mode="align", whose prefill checkpoints
    index per-chunk states (mamba_mixer2.py:880, `varlen_states[last_chunk_indices_p]`)
    that the CPU scan never returns (ops/cpu/mamba_ssm.py ignores
    `return_intermediate_states`): IndexError on any prompt longer than a block.
    """
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=128,
        shared_intermediate_size=128,
        num_local_experts=0,  # dense shared MLP, no MoE
        num_experts_per_tok=0,
        num_hidden_layers=2,
        layer_types=["linear_attention", "attention"],
        num_attention_heads=4,  # head_dim = 128 / 4 = 32
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=32,  # 8 * 32 = mamba_expand * hidden_size
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_state=8,  # keeps the Mamba state page (11 KiB) under a 32-token attention page
        mamba_d_conv=4,
        mamba_chunk_size=32,
        max_position_embeddings=512,
        position_embedding_type="rope",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = GraniteMoeHybridForCausalLM(cfg).float()
    model.save_pretrained(str(out))
    return {"architecture": "GraniteMoeHybridForCausalLM", "params": model.num_parameters()}


def _qwen3_next_files(out: Path) -> dict[str, Any]:
    """Qwen3-Next style hybrid: one Gated-DeltaNet layer, then one attention layer.

    The hybrid that runs on the CPU engine WITH prefix caching
    (mamba_cache_mode="align"), hence the one that can show mid-block store
    hits. Constraints met here: the CPU GDN kernel takes bfloat16 only
    ("CPU GDN attention requires BF16") and key/value head dim 128 ("Unexpected
    head dim size, 32"); vLLM's Qwen3Next needs at least one MoE layer
    (layer 1; layer 0 is dense via mlp_only_layers). 8 KV heads of 32 make the
    attention page big enough that vLLM sizes blocks at 96 tokens (the GDN
    state page is ~68 KiB); Qwen3.5 was not usable: vllm's qwen3_5.py imports
    torchvision, which is removed here.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        mlp_only_layers=[0],
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(cfg).bfloat16()
    model.save_pretrained(str(out))
    return {"architecture": "Qwen3NextForCausalLM", "params": model.num_parameters()}


HybridKind = Literal["qwen3_next", "granite"]
_HYBRIDS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "qwen3_next": _qwen3_next_files,
    "granite": _granite_hybrid_files,
}


def _ensure(name: str, path: str | os.PathLike[str] | None, build: Callable[[Path], dict]) -> Path:
    """Build into a temporary sibling folder and rename it into place.

    The rename makes concurrent callers (two engine processes, parallel test
    workers) safe: the loser of the race throws its copy away.
    """
    target = Path(path).expanduser() if path is not None else DEFAULT_ROOT / name
    marker = target / _MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("version") == _BUILD_VERSION:
                return target
        except (OSError, ValueError):
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        info = build(tmp)
        _save_tokenizer(tmp)
        (tmp / _MARKER).write_text(json.dumps({"version": _BUILD_VERSION, "seed": SEED, **info}))
        if target.exists():
            if (target / _MARKER).is_file() and path_is_current(target):
                return target  # another process finished first
            shutil.rmtree(target)  # stale or half-built
        try:
            os.rename(tmp, target)
        except OSError:
            if not path_is_current(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def path_is_current(path: Path) -> bool:
    """True when `path` holds a finished build of the current version."""
    try:
        return json.loads((path / _MARKER).read_text()).get("version") == _BUILD_VERSION
    except (OSError, ValueError):
        return False


def ensure_tiny_llama(path: str | os.PathLike[str] | None = None) -> Path:
    """Return a folder with a tiny float32 Llama (vocab 512, hidden 64, 2 layers,
    4 heads, 2 KV heads, head_dim 32) and its tokenizer, building it if needed."""
    return _ensure("tiny-llama", path, _llama_files)


def ensure_tiny_hybrid(
    path: str | os.PathLike[str] | None = None, kind: HybridKind = "qwen3_next"
) -> Path:
    """Return a folder with a tiny attention + linear-attention/Mamba hybrid.

    kind="qwen3_next" (default): 1 Gated-DeltaNet + 1 attention layer, bfloat16;
    runs with prefix caching (mamba_cache_mode="align"), so MooncakeStore hits
    can end mid-block. Start engines with dtype="bfloat16".
    kind="granite": 1 Mamba2 + 1 attention layer (GraniteMoeHybrid), float32;
    runs with NIXL, but only with prefix caching off on the CPU engine.
    """
    return _ensure(f"tiny-hybrid-{kind}", path, _HYBRIDS[kind])


if __name__ == "__main__":
    import sys

    which = sys.argv[1] if len(sys.argv) > 1 else "llama"
    where = sys.argv[2] if len(sys.argv) > 2 else None
    if which == "llama":
        print(ensure_tiny_llama(where))
    else:  # "qwen3_next" or "granite"
        print(ensure_tiny_hybrid(where, which))  # type: ignore[arg-type]
