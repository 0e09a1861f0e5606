"""Tiny, deterministic model directories for the real SGLang server on CPU.

* :func:`write_target` -- a Qwen3ForCausalLM (vocab 512, hidden 64, 3 layers, 4 heads, 2 KV
  heads, head_dim 16, untied lm_head, float32), saved with ``save_pretrained``.
  It comes with a byte-level tokenizer (ids 0-3 special, byte ``b`` = id ``4 + b``) so that
  the server can also take text, as a benchmark sends it.
* :func:`write_draft` -- a DFlash draft for it (``architectures: ["DFlashDraftModel"]``): one
  Qwen3 decoder layer without ``embed_tokens`` (the draft borrows the target's embedding and
  lm_head) plus ``fc.weight`` [hidden, 2*hidden] over the target's hidden states after layers
  ``[0, 1]`` and ``hidden_norm.weight``; its ``block_size`` is a parameter.

Random weights would make a useless test: a random draft is never right, so every verify
step accepts nothing and only the bonus token is ever committed. So the weights are built,
not trained, so that the draft is often right while the target still depends on its context
through attention:

* residual-stream layout: dims ``IDENT`` hold a token's own code (random unit vectors), dims
  ``COPY`` the code an attention head copied there, dim ``CONST`` a constant that every
  embedding (also the DFlash mask token's, whose code is zero) carries;
* the target's layer 0 has a *positional copy head* (queries and keys come from ``CONST``,
  so their RoPE dot product depends only on the distance; it peaks sharply at distance
  ``PERIOD - 1``) that copies the code of the token ``PERIOD - 1`` back into ``COPY``; the
  lm_head reads ``COPY`` only. So the target continues any prompt periodically,
  ``x[t+1] = x[t+1-PERIOD]``: a context-dependent rule that needs the KV cache of exactly
  the right positions. Layers 1-2 and all MLPs keep a random init (layers 1-2 with a larger
  o_proj, ``CONTENT_GAIN``): content-based attention that never overturns the copy's margin
  (> 13 logits) but moves the log-probabilities of the other tokens by 1e-2 or more when
  verify attention sees a wrong set of keys -- compare top log-probs, not only tokens;
* the draft has the same kind of head at distance ``PERIOD``, reading the codes of the
  committed tokens through ``fc`` (target hidden after layer 0: ``IDENT`` and ``CONST``) and
  the bonus token of the block: block positions ``1..PERIOD`` then predict exactly what the
  target will say, later ones see only mask tokens and miss. A verify step thus accepts up
  to ``PERIOD`` drafts (block size 8, PERIOD 4: accept length ~5).

Why 3 target layers: SGLang captures "after layer k" as "before layer k+1"
(srt/models/qwen3.py:793-805, the capture in the layer loop at qwen3.py:524-531), so the
output of the LAST layer can never be captured: with 2 layers, ``target_layer_ids [0, 1]``
yields one feature and the draft's ``fc`` rejects it (srt/models/dflash.py:834, "target_hidden
feature dim mismatch").

torch + transformers live only in the SGLang venv (``.cache/sglang-cpu/venv``), so the public
functions (stdlib only, importable from the project's own venv) run this file there as a
script. Fixed seeds: the same bytes every time for the same arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VOCAB = 512
HIDDEN = 64
INTERMEDIATE = 128
TARGET_LAYERS = 3
CAPTURED_LAYERS = [0, 1]  # draft fc input = len(CAPTURED_LAYERS) * HIDDEN
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
ROPE_THETA = 10000.0
MASK_TOKEN_ID = 3
BOS, EOS = 1, 2
CONTEXT_LEN = 2048  # max_position_embeddings: SGLang's context length for these models
PERIOD = 4  # the target repeats its last PERIOD tokens; the draft gets up to PERIOD right

# Residual-stream layout (see the module docstring). IDENT/COPY are 31 wide: kv head 0 carries
# dims 0-15 of a code, kv head 1 dims 16-30.
IDENT = range(31)
COPY = range(31, 62)
CONST = 62
CONST_VALUE = 5.0
ROPE_PAIRS = (0, 1, 2, 3)  # the 4 fastest RoPE frequencies: sharp, no aliasing within 300 tokens
QK_NORM_GAIN = 7.0  # score margin of the peak over its neighbours: GAIN^2 * 0.515 ~ 25 nats
COPY_GAIN = 3.0
# Layers 1-2 keep their random init, with o_proj scaled up: their attention then moves the
# logits of the non-chosen tokens by 1e-2..1e-1 when a verify mask or KV range is wrong
# (measured with transformers), while the chosen token's margin stays > 13 logits.
CONTENT_GAIN = 10.0


def _run_in_venv(*args: str) -> None:
    from .setup_env import venv_python  # stdlib only; not needed when run as a script

    python = venv_python()
    if not python.exists():
        raise RuntimeError(f"{python} missing: run `python3 tests/sglang_real/setup_env.py` first")
    proc = subprocess.run(
        [str(python), str(Path(__file__).resolve()), *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building a model failed ({' '.join(args)}):\n{proc.stdout}\n{proc.stderr}")


def write_target(dest: Path | str, *, seed: int = 0, lm_head_scale: float = 1.0) -> Path:
    """Write the tiny target model to ``dest`` (created); return it.

    ``lm_head_scale`` < 1 flattens every next-token distribution by the same factor on
    the logits (the copy's margin of > 13 logits becomes ``13 * scale``): a target whose
    samples at temperature 1 spread over several tokens, for statistical tests of the
    sampler. Its greedy continuation is the same periodic one.
    """
    dest = Path(dest)
    _run_in_venv("target", str(dest), "--seed", str(seed), "--lm-head-scale", repr(float(lm_head_scale)))
    return dest


def write_pair(root: Path | str, *, block_size: int = 8) -> dict[str, Path]:
    """Both models in one go (one interpreter start instead of two): ``root/target``,
    ``root/draft``; returns ``{"target": ..., "draft": ...}``."""
    root = Path(root)
    _run_in_venv("pair", str(root), "--block-size", str(block_size))
    return {"target": root / "target", "draft": root / "draft"}


def write_draft(
    dest: Path | str,
    *,
    block_size: int | None = 8,
    seed: int = 1,
    random_weights: bool = False,
    noise: float = 0.0,
) -> Path:
    """Write a tiny DFlash draft (for :func:`write_target`'s model) to ``dest``; return it.

    ``random_weights``: a plain random init instead of the copy head (a draft that is
    almost never right); ``block_size=None``: a config without ``block_size`` (a draft
    whose trained block a server cannot know); ``noise`` > 0: a perturbed copy (see
    :func:`write_perturbed_pair`).
    """
    dest = Path(dest)
    args = ["draft", str(dest), "--seed", str(seed), "--block-size", str(block_size or 0)]
    if random_weights:
        args.append("--random")
    if noise:
        args += ["--noise", repr(float(noise))]
    _run_in_venv(*args)
    return dest


# The perturbed pair's defaults (write_perturbed_pair). Measured on the real CPU server
# (tests/sglang_real/test_ddtree_trace.py prints them; block 8): mean accepted length per
# round (bonus included) at T = 0: chain (4, 1) 1.61, tree (4, 2) 1.80, the union of
# (4, 1), (8, 2), (16, 4) 2.56; at T = 1: tree (4, 2) 1.82 (pinned), (16, 4) 2.35
# (predicted from a trace). The exact copy (noise 0) gives ~5 at T = 0.
PERTURBED_NOISE = 2.0
PERTURBED_LM_HEAD_SCALE = 0.3


def write_perturbed_pair(
    root: Path | str,
    *,
    noise: float = PERTURBED_NOISE,
    lm_head_scale: float = PERTURBED_LM_HEAD_SCALE,
    block_size: int = 8,
    seed: int = 0,
) -> dict[str, Path]:
    """A target and a draft that agrees with it only partly: ``root/target``,
    ``root/draft``; returns ``{"target": ..., "draft": ...}``.

    * ``noise``: the draft's ``fc`` maps a committed token's code ``c`` to
      ``c + noise * M c`` (``M`` a fixed random matrix with ``|M c| ~ |c|``) instead of
      ``c``, so its copy head reads a blurred code: the right token still has the best
      mean logit, but for some tokens another one beats it (rank 1..3 or lower), fixed
      per token. 0 is the exact copy (accept length ~5 with block 8); the larger, the
      fewer rounds the draft's top choice is right.
    * ``lm_head_scale``: :func:`write_target`'s flattening of the target (the draft
      borrows the target's lm_head, so its log-probs flatten alike): at temperature 1
      the target's samples then leave its greedy continuation, so acceptance at T = 1
      has real spread too. The greedy continuation is the same periodic one.
    * ``seed``: the target's seed (the draft's is ``seed + 1``, its noise matrix is
      drawn from it).
    """
    root = Path(root)
    _run_in_venv("pair", str(root), "--block-size", str(block_size), "--seed", str(seed),
                 "--noise", repr(float(noise)), "--lm-head-scale", repr(float(lm_head_scale)))
    return {"target": root / "target", "draft": root / "draft"}


# ---------------------------------------------------------------------------------------------
# Below: runs inside the SGLang venv only.


def _qwen3_config(num_layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT_LEN,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def _codes(seed: int):
    """[VOCAB, HIDDEN] embedding: a unit code per token in IDENT (zero for the mask), CONST."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randn(VOCAB, len(IDENT), generator=gen)
    codes = codes / codes.norm(dim=1, keepdim=True) * len(IDENT) ** 0.5
    codes[MASK_TOKEN_ID] = 0.0
    emb = torch.zeros(VOCAB, HIDDEN)
    emb[:, IDENT.start : IDENT.stop] = codes
    emb[:, CONST] = CONST_VALUE
    return emb


def _copy_head(attn, distance: int) -> None:
    """Make a Qwen3 attention module copy IDENT of the token ``distance`` back into COPY.

    q heads 0 and 2 (one per kv head) attend by position only: q and k are constant vectors
    read from CONST, laid out on the RoPE pairs ROPE_PAIRS so that after rotation
    q.k = GAIN^2 * sum_i cos((m - n - distance) * theta_i): peak 4 at ``m - n == distance``,
    at most 3.485 anywhere else within 300 positions. Values carry IDENT; o_proj writes it to
    COPY. q heads 1 and 3 are off (zero q and zero o_proj columns).
    """
    import math

    import torch

    a_q = torch.zeros(HEAD_DIM)
    a_k = torch.zeros(HEAD_DIM)
    half = HEAD_DIM // 2  # neox-style RoPE pairs (i, i + half)
    for i in ROPE_PAIRS:
        theta = ROPE_THETA ** (-2.0 * i / HEAD_DIM)
        a_q[i], a_q[i + half] = math.cos(distance * theta), -math.sin(distance * theta)
        a_k[i] = 1.0
    q = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
    k = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN)
    v = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN)
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    group = HEADS // KV_HEADS
    ident = list(IDENT)
    copy = list(COPY)
    for kv in range(KV_HEADS):
        qh = kv * group  # the first q head of this kv group
        q[qh * HEAD_DIM : (qh + 1) * HEAD_DIM, CONST] = a_q
        k[kv * HEAD_DIM : (kv + 1) * HEAD_DIM, CONST] = a_k
        part = ident[kv * HEAD_DIM : (kv + 1) * HEAD_DIM]
        for j, dim in enumerate(part):
            v[kv * HEAD_DIM + j, dim] = 1.0
            o[copy[kv * HEAD_DIM + j], qh * HEAD_DIM + j] = COPY_GAIN
    with torch.no_grad():
        attn.q_proj.weight.copy_(q)
        attn.k_proj.weight.copy_(k)
        attn.v_proj.weight.copy_(v)
        attn.o_proj.weight.copy_(o)
        attn.q_norm.weight.fill_(QK_NORM_GAIN)
        attn.k_norm.weight.fill_(QK_NORM_GAIN)


def _build_target(dest: Path, seed: int, lm_head_scale: float = 1.0) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_qwen3_config(TARGET_LAYERS)).to(torch.float32)
    emb = _codes(seed)
    lm_head = torch.zeros(VOCAB, HIDDEN)
    lm_head[:, COPY.start : COPY.stop] = emb[:, IDENT.start : IDENT.stop] * lm_head_scale
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(lm_head)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(CONTENT_GAIN)
    _copy_head(model.model.layers[0].self_attn, PERIOD - 1)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    _write_tokenizer(dest)


def _write_tokenizer(dest: Path) -> None:
    """A byte-level tokenizer over the whole vocabulary, so that the server can also run
    with its tokenizer (what a benchmark sends is text): ids 0-3 are the special tokens
    (pad, BOS, EOS, the DFlash mask token), each byte ``b`` is id ``4 + b``, the rest are
    filler tokens that only the model can produce. No merges: one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<mask>"]
    assert specials.index("<bos>") == BOS and specials.index("<eos>") == EOS
    assert specials.index("<mask>") == MASK_TOKEN_ID
    table = _bytes_to_unicode()  # ByteLevel.alphabet() has the characters, not their byte order
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({table[b]: len(specials) + b for b in range(256)})
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        additional_special_tokens=["<mask>"],
    )
    # A chat template, so that chat prompts reach /generate as the server's own rendering
    # (/v1/tokenize): each turn ``<|role|>content`` and a newline, then ``<|assistant|>``.
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_chat(messages: list[tuple[str, str]]) -> str:
    """What CHAT_TEMPLATE renders ``messages`` to, with the generation prompt."""
    return "".join(f"<|{role}|>{content}\n" for role, content in messages) + "<|assistant|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _build_draft(dest: Path, seed: int, block_size: int, random_weights: bool = False, noise: float = 0.0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    cfg = _qwen3_config(1)
    model = Qwen3Model(cfg).to(torch.float32)
    if not random_weights:
        _copy_head(model.layers[0].self_attn, PERIOD)
        with torch.no_grad():
            model.layers[0].mlp.down_proj.weight.zero_()  # the draft is its copy head, nothing else
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("embed_tokens")}
    if random_weights:
        fc = torch.randn(HIDDEN, len(CAPTURED_LAYERS) * HIDDEN) * 0.05
    else:
        # fc: the committed tokens' codes (IDENT) and CONST from the target's hidden after layer 0.
        fc = torch.zeros(HIDDEN, len(CAPTURED_LAYERS) * HIDDEN)
        for dim in (*IDENT, CONST):
            fc[dim, dim] = 1.0
        if noise:
            # A perturbed copy (write_perturbed_pair): IDENT -> IDENT + noise * M, |M c| ~ |c|.
            gen = torch.Generator().manual_seed(seed + 1000)
            blur = torch.randn(len(IDENT), len(IDENT), generator=gen) / len(IDENT) ** 0.5
            fc[IDENT.start : IDENT.stop, IDENT.start : IDENT.stop] += noise * blur
    state["fc.weight"] = fc
    state["hidden_norm.weight"] = torch.ones(HIDDEN)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        num_target_layers=TARGET_LAYERS,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": CAPTURED_LAYERS},
    )
    if block_size:
        config["block_size"] = block_size
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["target", "draft", "pair"])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--lm-head-scale", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.0)
    a = ap.parse_args(argv)
    if a.kind == "target":
        _build_target(a.dest, a.seed, a.lm_head_scale)
    elif a.kind == "draft":
        _build_draft(a.dest, a.seed, a.block_size, a.random, a.noise)
    else:  # the defaults of write_target / write_draft, or write_perturbed_pair's
        _build_target(a.dest / "target", a.seed, a.lm_head_scale)
        _build_draft(a.dest / "draft", a.seed + 1, a.block_size, noise=a.noise)


if __name__ == "__main__":
    _main(sys.argv[1:])
