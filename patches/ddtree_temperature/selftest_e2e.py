"""End-to-end self-test of a DEPLOYED ddtree_temperature bundle on the host's own SGLang.

Run by the interpreter SGLang runs under (stdlib, plus torch and safetensors, which
SGLang itself requires)::

    python selftest_e2e.py ['{"budgets": [4, 16], "graphs": ["off"]}']

A deployment tool may instead send this program on stdin behind a small bootstrap that
defines ``PAYLOAD``, the decoded JSON document ``{"params": {...}, "selftest":
"<selftest.py's text>"}`` (so that no parameter, e.g. an environment value, shows on a
command line), and ``reply``, which the report is then sent with (one framed message
the tool can tell from anything else on stdout); run by hand, ``argv[1]`` holds the parameters, the
``selftest.py`` beside this file is used and the report is one JSON line on stdout. Parameters, every key optional (see ``DEFAULTS``): ``budgets``, ``graphs`` ("on": SGLang's default
decode CUDA graphs, "off": ``--cuda-graph-backend-decode disabled``), ``topk``,
``block_size`` (the draft's trained block), ``new_tokens``, ``prompts`` (token-id lists;
the first is sent alone, then all of them as one batch), ``extra_args`` / ``env`` (the
host's usual server flags and environment), ``launch_timeout`` (seconds per launch),
``tie_margin`` (nats), ``keep`` (keep the work directory), ``server_command`` (the argv
that starts the host's server, default ``[<this python>, "-m", "sglang.launch_server"]``),
``bisect`` (budgets to bisect, see below; then ``budgets`` and ``graphs`` are not run).

Bisection (``bisect``: a list of budgets, e.g. ``[8, 9, 10, 12, 16]``): DDTREE launches
with decode CUDA graphs on, in ascending budget order, until one fails (a capture crash,
a server that dies, or wrong tokens). That budget is launched twice more: with
``CUDA_LAUNCH_BLOCKING=1`` (CUDA reports the failing kernel where it fails, not at a
later call) and with ``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1`` (the candidate head runs
eagerly after the captured draft forward: the head, ``candidate_topk`` -> Triton
``lilicorr_topk_lse``, is the only code a DDTREE draft graph captures that DFlash's does
not). The report's ``bisect`` object: ``budgets``, ``tried`` (per launch ``budget``,
``ok``, ``captured``, ``error``), ``first_failing`` (null when all served), ``blocking``
and ``eager_head`` (the two reruns, null without a failure), and ``eager_head_avoids``.

What it does, without downloading anything: writes a tiny Qwen3 target (vocab 2048,
hidden 256, 4 layers, 8 heads of 64, 2 KV heads) and a one-layer DFlash draft for it
(``target_layer_ids`` [1, 2]: SGLang captures "after layer k" before layer k+1, so the
last layer cannot be captured) into a temporary directory, with seeded random weights.
Why not ``--load-format dummy``: SGLang's dummy weights are uniform in +-1e-3, which
makes the target's logits equal to ~1e-6 and its output independent of the context
(attention is uniform, each token's own embedding decides the next one), so neither a
wrong tree mask nor a wrong KV range could change a single token, and every position
would be a near-tie. Here embeddings are N(0, 1), projections keep the variance, norms
are 1 (so attention depends on the content), and only 16 tokens get non-zero lm_head
rows (logit std 2): the target's choice is always one of those 16, and so are the
draft's top candidates (the draft borrows the target's lm_head), so a random draft is
right often enough (accept length ~1.1 at top-k 4; at any sibling rank) that accepted
paths run through the tree and its KV compaction. ``enable_lm_head_output_fp32`` keeps bf16 logits
from being rounded to ~0.03.

Then: runs ``selftest.py`` (the unit checks, kernel vs reference on identical coins where
CUDA and SGLang's kernel are available) with this interpreter; launches the server
(``python -m sglang.launch_server``, a free port on 127.0.0.1, its own session, its log
in the work directory) once without speculation and once per (budget, graph mode) with
``--speculative-algorithm DDTREE``; waits for "The server is fired up and ready to
roll!" (or the process dying, or ``launch_timeout``: the log tail is reported); runs
greedy ``/generate`` with top-2 log-probs, compares each run with the target alone token
for token; reads ``/server_info``'s ``ddtree`` object; stops the server (SIGTERM to the
launcher, SIGKILL to its process group after a grace). No server outlives this script:
every launch is stopped in a ``finally`` (also on Ctrl-C, SIGTERM, SIGHUP), and the
launcher dies with this process even if it is SIGKILLed (``PR_SET_PDEATHSIG``; SGLang's
own children die with the launcher the same way). The work directory (under the ``env``
parameter's TMPDIR if it sets one) is also the servers' TMPDIR, so SGLang's IPC sockets
and temp files are removed with it.

Near-ties: the target alone and DDTREE run different kernels (one-token decode vs a
tree verify), so in bf16 their logits differ in the last bits and greedy choices can
flip where the top two are nearly equal. At the first diverging position the target
alone's top-2 log-prob margin is recorded; a divergence with a margin below
``tie_margin`` (default 0.02 nats) is a "tie" and does not fail, any other divergence
fails. In float32 (CPU) the outputs must simply be equal.

Prints ONE JSON object on stdout::

    {"ok", "deployed", "sglang_version", "python", "device", "gpu_arch", "torch", "cuda", "kernel",
     "checks": {name: {"ok", "detail"}},            # selftest.py's checks
     "baseline": {"served", "startup_s", "error"},
     "runs": [{"budget", "graphs", "ok", "served", "equal", "compared_tokens",
               "divergences", "first_divergence": null | {"batch", "prompt",
               "position", "margin", "verdict", "want", "got"},
               "max_logprob_delta", "accept_length", "verify_cuda_graph_captured",
               "verify_cuda_graph_max_bs", "verify_attention_backend", "draft_attention_backend",
               "decode_cuda_graph", "ddtree", "startup_s", "error", "log_tail"}],
     "graph_capture": {budget: bool},                 # graph mode "on" runs
     "bisect": null | {...},                          # see Bisection
     "params", "seconds", "error"}

Exit status: 0 every check and run passed, 1 something failed, 2 nothing could be tested
(bundle not deployed, SGLang or torch missing, bad parameters), 130 interrupted.
"""

import importlib.metadata
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

READY_LINE = "The server is fired up and ready to roll!"
CAPTURE_FAILED = "Capture cuda graph failed"  # then the scheduler dies and takes the server down
DEFAULTS = {
    "budgets": [4, 8, 16, 32],
    "graphs": ["on", "off"],
    "topk": 4,
    "block_size": 16,
    "new_tokens": 32,
    "prompts": [
        [100, 7, 1500, 23, 42, 900, 5, 77],
        [3, 1999],
        [200, 201, 88, 13, 77, 480, 350, 12, 11, 10, 300, 299, 298, 45, 46, 47, 48, 222, 111],
    ],
    "extra_args": [],
    "env": {},
    "launch_timeout": 900.0,
    "tie_margin": 0.02,
    "keep": False,
    "server_command": None,
    "bisect": None,
}
EAGER_HEAD_ENV = {"SGLANG_DFLASH_EAGER_DRAFT_SAMPLER": "1"}
BLOCKING_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
EAGER_DECODE = ["--cuda-graph-backend-decode", "disabled"]
TOP_LOGPROBS = 2
LOG_TAIL_LINES = 40
STOP_GRACE_S = 15.0
INTERRUPT_GRACE_S = 1.0  # a deployment tool SIGKILLs us ~2 s after SIGTERM
# SGLang names its ZMQ IPC sockets tempfile.NamedTemporaryFile() paths; a Unix socket path
# has at most 107 bytes, so the work dir becomes the servers' TMPDIR only when short.
MAX_TMPDIR_LEN = 90

# The tiny models (see the module docstring).
VOCAB = 2048
HIDDEN = 256
INTERMEDIATE = 512
TARGET_LAYERS = 4
CAPTURED_LAYERS = [1, 2]
HEADS = 8  # divisible by a --tp-size of up to 8 from the host's flags
KV_HEADS = 2
HEAD_DIM = 64
ACTIVE = range(16, 32)  # the only tokens with non-zero lm_head rows
LOGIT_STD = 2.0
EOS = VOCAB - 2  # never generated (zero logit row); ignore_eos anyway
MASK_TOKEN = VOCAB - 1
SEED = 20260


class Interrupted(BaseException):
    """SIGTERM / SIGHUP: handled like Ctrl-C."""


class LaunchError(Exception):
    def __init__(self, message, log_tail=""):
        super().__init__(message)
        self.log_tail = log_tail


class RequestError(Exception):
    pass


# ------------------------------------------------------------------------- parameters


def read_inputs(argv):
    """(parameters as given, selftest.py's text or None): from ``PAYLOAD`` or argv + file."""
    doc = globals().get("PAYLOAD")
    if doc is not None:
        if not isinstance(doc, dict):
            raise ValueError("the payload must be one JSON object")
        return doc.get("params") or {}, doc.get("selftest")
    given = json.loads(argv[0]) if argv and argv[0].strip() else {}
    here = globals().get("__file__")
    path = os.path.join(os.path.dirname(os.path.abspath(here)), "selftest.py") if here else ""
    if not os.path.isfile(path):
        return given, None
    with open(path) as f:
        return given, f.read()


def parse_params(given):
    """The parameters with defaults filled in; ValueError names the bad key."""
    if not isinstance(given, dict):
        raise ValueError("parameters must be one JSON object")
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError("unknown parameter(s): %s" % ", ".join(unknown))
    p = dict(DEFAULTS, **given)

    def ints(key, lo, hi):
        v = p[key]
        if not isinstance(v, list) or not v or not all(_is_int(x) and lo <= x <= hi for x in v):
            raise ValueError("%s: a non-empty list of integers in %d..%d" % (key, lo, hi))

    ints("budgets", 1, 256)
    if not isinstance(p["graphs"], list) or not p["graphs"] or not set(p["graphs"]) <= {"on", "off"}:
        raise ValueError('graphs: a non-empty list of "on" / "off"')
    for key, lo, hi in (("topk", 1, 256), ("block_size", 2, 257), ("new_tokens", 1, 4096)):
        if not _is_int(p[key]) or not lo <= p[key] <= hi:
            raise ValueError("%s: an integer in %d..%d" % (key, lo, hi))
    prompts = p["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts: a non-empty list of token-id lists")
    for ids in prompts:
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and 0 <= t < VOCAB for t in ids):
            raise ValueError("prompts: each a non-empty list of token ids in 0..%d" % (VOCAB - 1))
    if not isinstance(p["extra_args"], list) or not all(isinstance(a, str) for a in p["extra_args"]):
        raise ValueError("extra_args: a list of strings")
    env = p["env"]
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env: an object of strings")
    for key in ("launch_timeout", "tie_margin"):
        if isinstance(p[key], bool) or not isinstance(p[key], (int, float)) or p[key] < 0:
            raise ValueError("%s: a non-negative number" % key)
    if not isinstance(p["keep"], bool):
        raise ValueError("keep: true or false")
    command = p["server_command"]
    if command is not None and (
        not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command)
    ):
        raise ValueError("server_command: a non-empty list of strings")
    if p["bisect"] is not None:
        ints("bisect", 1, 256)
        p["bisect"] = sorted(set(p["bisect"]))
    p["budgets"] = list(dict.fromkeys(p["budgets"]))
    p["graphs"] = list(dict.fromkeys(p["graphs"]))
    return p


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------ models


def _qwen3_config(layers):
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": EOS,
    }


def write_models(root, block_size):
    """``root/target`` and ``root/draft``: configs and seeded random safetensors."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)

    def randn(rows, cols, std):
        return (torch.randn(rows, cols, generator=gen) * std).contiguous()

    def decoder_layer(prefix):
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        return {
            prefix + "input_layernorm.weight": torch.ones(HIDDEN),
            prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            prefix + "self_attn.q_proj.weight": randn(q, HIDDEN, HIDDEN ** -0.5),
            prefix + "self_attn.k_proj.weight": randn(kv, HIDDEN, HIDDEN ** -0.5),
            prefix + "self_attn.v_proj.weight": randn(kv, HIDDEN, HIDDEN ** -0.5),
            prefix + "self_attn.o_proj.weight": randn(HIDDEN, q, q ** -0.5),
            prefix + "self_attn.q_norm.weight": torch.ones(HEAD_DIM),
            prefix + "self_attn.k_norm.weight": torch.ones(HEAD_DIM),
            prefix + "mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN, HIDDEN ** -0.5),
            prefix + "mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN, HIDDEN ** -0.5),
            prefix + "mlp.down_proj.weight": randn(HIDDEN, INTERMEDIATE, INTERMEDIATE ** -0.5),
        }

    lm_head = torch.zeros(VOCAB, HIDDEN)
    lm_head[ACTIVE.start : ACTIVE.stop] = randn(len(ACTIVE), HIDDEN, LOGIT_STD * HIDDEN ** -0.5)
    target = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN, 1.0), "model.norm.weight": torch.ones(HIDDEN),
              "lm_head.weight": lm_head}
    for i in range(TARGET_LAYERS):
        target.update(decoder_layer("model.layers.%d." % i))
    draft = decoder_layer("layers.0.")
    draft.update({
        "norm.weight": torch.ones(HIDDEN),
        "hidden_norm.weight": torch.ones(HIDDEN),
        "fc.weight": randn(HIDDEN, len(CAPTURED_LAYERS) * HIDDEN, (len(CAPTURED_LAYERS) * HIDDEN) ** -0.5),
    })
    target_cfg = dict(_qwen3_config(TARGET_LAYERS), enable_lm_head_output_fp32=True)
    draft_cfg = dict(
        _qwen3_config(1),
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"mask_token_id": MASK_TOKEN, "target_layer_ids": CAPTURED_LAYERS},
    )
    dirs = {}
    for name, tensors, cfg in (("target", target, target_cfg), ("draft", draft, draft_cfg)):
        path = os.path.join(root, name)
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1, sort_keys=True)
        dirs[name] = path
    return dirs


# ------------------------------------------------------------------------------ server

# Runs as ``python -c _LAUNCH PARENT_PID <server command> ...``: the launcher gets SIGKILL
# when this script dies (PR_SET_PDEATHSIG survives the exec), then execs the command.
_LAUNCH = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "if os.getppid()!=int(sys.argv[1]):sys.exit(1)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


# Loopback requests never go through the host's http_proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_SECRET_FLAGS = ("--api-key", "--admin-api-key")


def _api_key(args):
    """The ``--api-key`` the host's flags give the server (requests must carry it)."""
    key = None
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            key = args[i + 1]
        elif arg.startswith("--api-key="):
            key = arg.split("=", 1)[1]
    return key


def _redacted(args):
    out = []
    for arg in args:
        if out and out[-1] in _SECRET_FLAGS:
            arg = "***"
        elif arg.startswith(tuple(f + "=" for f in _SECRET_FLAGS)):
            arg = arg.split("=", 1)[0] + "=***"
        out.append(arg)
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_pids(pgid):
    """Live (not zombie) members of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # after "pid (comm)": state ppid pgrp
                pids.append(int(entry))
    return pids


def _mapped_shm(pids):
    """The /dev/shm/sglang_loads_* files SGLang maps and never unlinks."""
    found = set()
    for pid in pids:
        try:
            with open("/proc/%d/maps" % pid) as f:
                for line in f:
                    path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/sglang_loads_"):
                        found.add(path.replace(" (deleted)", ""))
        except OSError:
            continue
    return found


class Server:
    """One ``sglang.launch_server`` in its own session; ``with`` stops it whatever happens."""

    def __init__(self, name, model, args, env, workdir, command=None):
        self.port = _free_port()
        command = command or [sys.executable, "-m", "sglang.launch_server"]
        self.argv = [sys.executable, "-c", _LAUNCH, str(os.getpid()), *command,
                     "--model-path", model, "--host", "127.0.0.1", "--port", str(self.port),
                     "--skip-tokenizer-init", *args]
        self.env = env
        self.api_key = _api_key(args)
        self.workdir = workdir
        self.log_path = os.path.join(workdir, name + ".log")
        self.proc = None
        self.shm = set()

    def log_tail(self, lines=LOG_TAIL_LINES):
        try:
            with open(self.log_path, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def log_line(self, text):
        """The first log line holding ``text`` (stripped, at most 300 characters), or None."""
        try:
            with open(self.log_path, errors="replace") as f:
                return next((ln.strip()[:300] for ln in f if text in ln), None)
        except OSError:
            return None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        interrupted = exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, Interrupted))
        self.stop(INTERRUPT_GRACE_S if interrupted else STOP_GRACE_S)

    def start(self, timeout):
        """Launch; wait for the ready line. Returns the startup seconds."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.workdir,
                                         start_new_session=True)
        while True:
            time.sleep(0.5)
            with open(self.log_path, "rb") as f:
                if READY_LINE.encode() in f.read():
                    break
            if self.proc.poll() is not None:
                message = "the server exited with code %s before it was ready" % self.proc.returncode
                capture = self.log_line(CAPTURE_FAILED)
                raise LaunchError("CUDA-graph capture failed: " + capture if capture else message, self.log_tail())
            if time.monotonic() - t0 > timeout:
                raise LaunchError("the server was not ready after %.0f s" % timeout, self.log_tail())
        self.shm |= _mapped_shm(_group_pids(self.proc.pid))
        return round(time.monotonic() - t0, 1)

    def stop(self, grace):
        """SIGTERM to the launcher (it ends its children), SIGKILL to the group after ``grace``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)  # a second Ctrl-C must not cut this short
        try:
            self.shm |= _mapped_shm(_group_pids(proc.pid))
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            for wait, sig in ((grace, signal.SIGKILL), (5.0, None)):
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    proc.poll()  # reap the launcher
                    if not _group_pids(proc.pid):
                        break
                    time.sleep(0.1)
                if sig is not None:
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
            proc.wait(timeout=10)
            for path in self.shm:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def _call(self, method, path, body=None, timeout=600.0, parse=True):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (self.port, path), data=data, method=method,
                                     headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                raw = resp.read()
            return json.loads(raw) if parse else raw
        except urllib.error.HTTPError as exc:
            body = exc.read()[:500].decode(errors="replace")
            raise RequestError("%s %s -> HTTP %d: %s" % (method, path, exc.code, body))
        except (OSError, ValueError) as exc:
            alive = self.proc is not None and self.proc.poll() is None
            raise RequestError("%s %s failed: %s%s" % (method, path, exc, "" if alive else " (the server died)"))

    def generate(self, prompts, new_tokens):
        self._call("POST", "/flush_cache", parse=False)
        out = self._call("POST", "/generate", {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": TOP_LOGPROBS,
        })
        out = out if isinstance(out, list) else [out]
        if len(out) != len(prompts) or not all(isinstance(o, dict) and "output_ids" in o for o in out):
            raise RequestError("/generate answered %r" % (str(out)[:300],))
        return out

    def server_info(self):
        return self._call("GET", "/server_info", timeout=60.0)


# -------------------------------------------------------------------------- comparing


def _top(meta, pos):
    tops = meta.get("output_top_logprobs") or []
    return tops[pos] if pos < len(tops) and tops[pos] else []


def compare(cases, tie_margin):
    """``cases``: [(target-alone outputs, DDTREE outputs)] per request. Token by token.

    Returns ``equal``, ``compared_tokens`` (positions compared before each prompt's first
    divergence), ``divergences`` (how many prompts diverged), ``first_divergence`` (the
    first that is not a tie, else the first tie; ``margin``: the target alone's top-2
    log-prob margin there) and ``max_logprob_delta`` (largest difference of the chosen
    token's log-prob over the compared positions).
    """
    compared, found, delta = 0, [], 0.0
    for want_batch, got_batch in cases:
        for prompt, (want, got) in enumerate(zip(want_batch, got_batch)):
            w_ids, g_ids = want["output_ids"], got["output_ids"]
            n = min(len(w_ids), len(g_ids))
            pos = next((i for i in range(n) if w_ids[i] != g_ids[i]), None)
            if pos is None and len(w_ids) != len(g_ids):
                pos = n
            upto = n if pos is None else pos
            compared += upto
            for i in range(upto):
                w_top, g_top = _top(want["meta_info"], i), _top(got["meta_info"], i)
                if w_top and g_top and w_top[0][0] is not None and g_top[0][0] is not None:
                    delta = max(delta, abs(w_top[0][0] - g_top[0][0]))
            if pos is None:
                continue
            top = _top(want["meta_info"], pos)
            margin = None
            if pos < len(w_ids) and pos < len(g_ids) and len(top) >= 2 and None not in (top[0][0], top[1][0]):
                margin = top[0][0] - top[1][0]
            found.append({
                "batch": len(want_batch), "prompt": prompt, "position": pos,
                "margin": None if margin is None else round(margin, 6),
                "verdict": "tie" if margin is not None and margin < tie_margin else "diverged",
                "want": w_ids[pos] if pos < len(w_ids) else None,
                "got": g_ids[pos] if pos < len(g_ids) else None,
            })
    hard = [d for d in found if d["verdict"] != "tie"]
    return {
        "equal": not found,
        "compared_tokens": compared,
        "divergences": len(found),
        "first_divergence": (hard or found or [None])[0],
        "max_logprob_delta": float("%.3g" % delta),
    }


def accept_length(outputs):
    lengths = [o["meta_info"].get("spec_accept_length") for b in outputs for o in b]
    lengths = [x for x in lengths if isinstance(x, (int, float)) and not math.isnan(x)]
    return round(sum(lengths) / len(lengths), 3) if lengths else None


# --------------------------------------------------------------------------------- run


def _requests(params):
    prompts = params["prompts"]
    return [prompts[:1], prompts] if len(prompts) > 1 else [prompts]


def run_baseline(params, models, env, work):
    rec = {"served": False, "startup_s": None, "error": None}
    outputs = None
    with Server("baseline", models["target"], params["extra_args"], env, work, params["server_command"]) as srv:
        try:
            rec["startup_s"] = srv.start(params["launch_timeout"])
            outputs = [srv.generate(p, params["new_tokens"]) for p in _requests(params)]
            rec["version"] = srv.server_info().get("version")
            rec["served"] = True
        except LaunchError as exc:
            rec.update(error=str(exc), log_tail=exc.log_tail)
        except RequestError as exc:
            rec.update(error=str(exc), log_tail=srv.log_tail())
    return rec, outputs


def run_ddtree(params, models, env, work, budget, graphs, want, label=""):
    rec = {"budget": budget, "graphs": graphs, "ok": False, "served": False, "equal": None,
           "compared_tokens": 0, "divergences": 0, "first_divergence": None, "max_logprob_delta": None,
           "accept_length": None, "verify_cuda_graph_captured": None, "verify_cuda_graph_max_bs": None,
           "verify_attention_backend": None,
           "draft_attention_backend": None, "decode_cuda_graph": None, "ddtree": None,
           "startup_s": None, "error": None}
    args = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", models["draft"],
            "--speculative-num-draft-tokens", str(budget + 1), "--speculative-eagle-topk", str(params["topk"]),
            *(EAGER_DECODE if graphs == "off" else []), *params["extra_args"]]
    name = "ddtree-b%d-graphs-%s%s" % (budget, graphs, label)
    with Server(name, models["target"], args, env, work, params["server_command"]) as srv:
        try:
            rec["startup_s"] = srv.start(params["launch_timeout"])
            tree = srv.server_info().get("ddtree")
            if not isinstance(tree, dict):
                raise RequestError("/server_info has no ddtree object: the DDTREE plugin did not load")
            rec["ddtree"] = tree
            # verify_cuda_graph_max_bs: the largest batch its verify graph replays (above: eager)
            for key in ("verify_cuda_graph_captured", "verify_cuda_graph_max_bs", "verify_attention_backend",
                        "draft_attention_backend", "decode_cuda_graph"):
                rec[key] = tree.get(key)
            got = [srv.generate(p, params["new_tokens"]) for p in _requests(params)]
            rec["served"] = True
        except LaunchError as exc:
            rec.update(error=str(exc), log_tail=exc.log_tail)
            return rec
        except RequestError as exc:
            rec.update(error=str(exc), log_tail=srv.log_tail())
            return rec
    rec.update(compare(list(zip(want, got)), params["tie_margin"]))
    rec["accept_length"] = accept_length(got)
    verified = sum(o["meta_info"].get("spec_verify_ct") or 0 for b in got for o in b)
    if not verified:
        rec["error"] = "no verify step in any response: the server did not speculate"
    elif rec["first_divergence"] and rec["first_divergence"]["verdict"] != "tie":
        d = rec["first_divergence"]
        rec["error"] = "diverged from the target alone at token %d of prompt %d (batch %d), margin %s" % (
            d["position"], d["prompt"], d["batch"], d["margin"])
    rec["ok"] = rec["error"] is None
    return rec


def _bisect_entry(run):
    return {"budget": run["budget"], "ok": run["ok"], "captured": run["verify_cuda_graph_captured"],
            "error": run["error"]}


def run_bisect(params, models, env, work, want):
    """The first budget whose decode-graph launch fails, and what the two reruns say."""
    out = {"budgets": params["bisect"], "tried": [], "first_failing": None, "blocking": None,
           "eager_head": None, "eager_head_avoids": None}
    for budget in params["bisect"]:
        run = run_ddtree(params, models, env, work, budget, "on", want)
        out["tried"].append(_bisect_entry(run))
        if run["ok"]:
            continue
        out["first_failing"] = budget
        blocking = run_ddtree(params, models, dict(env, **BLOCKING_ENV), work, budget, "on", want, "-blocking")
        out["blocking"] = dict(_bisect_entry(blocking), log_tail=blocking.get("log_tail", ""))
        eager = run_ddtree(params, models, dict(env, **EAGER_HEAD_ENV), work, budget, "on", want, "-eager-head")
        out["eager_head"] = _bisect_entry(eager)
        out["eager_head_avoids"] = bool(eager["ok"])
        break
    return out


def run_checks(source, env, work, timeout=900.0):
    """selftest.py with this interpreter: its report (a dict), or raises RuntimeError."""
    path = os.path.join(work, "selftest.py")
    with open(path, "w") as f:
        f.write(source)
    proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, cwd=work,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        report = None
    if not isinstance(report, dict):
        raise RuntimeError("selftest.py gave no report (exit %d): %s" % (proc.returncode, proc.stderr[-800:]))
    report["exit"] = proc.returncode
    return report


def _device(cuda):
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    names = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if names:
        return "%s x%d" % (names[0], len(names)) if len(set(names)) == 1 else ", ".join(names)
    return "cuda" if cuda else "cpu"


def _gpu_arch():
    """``sm_XY`` of the first GPU nvidia-smi lists (what an eager fallback is keyed by)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    caps = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return "sm_" + caps[0].replace(".", "") if caps and caps[0].replace(".", "").isdigit() else None


def _emit(report, start, code):
    report["seconds"] = round(time.monotonic() - start, 1)
    send = globals().get("reply")
    if send is not None:  # sent behind a deployment tool's bootstrap: its framed message
        send(report)
    else:
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
        sys.stdout.flush()
    sys.exit(code)


def _on_signal(signum, frame):
    raise Interrupted(signum)


def main(argv):
    start = time.monotonic()
    report = {"ok": False, "deployed": False, "python": sys.executable, "sglang_version": None, "device": None,
              "gpu_arch": None, "checks": {}, "kernel": None, "baseline": None, "runs": [], "graph_capture": {},
              "bisect": None, "error": None}
    try:
        given, source = read_inputs(argv)
        params = parse_params(given)
    except ValueError as exc:
        report["error"] = "bad parameters: %s" % exc
        _emit(report, start, 2)
    # What ran, without secrets: env values and API keys stay out of the report.
    report["params"] = dict(params, env=sorted(params["env"]), extra_args=_redacted(params["extra_args"]))
    try:
        report["sglang_version"] = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        report["error"] = "sglang is not installed for %s" % sys.executable
        _emit(report, start, 2)
    if not source:
        report["error"] = "selftest.py not found (it belongs beside this script)"
        _emit(report, start, 2)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(params["env"])
    # Under the server's own TMPDIR if the host sets one (e.g. /tmp is noexec for JIT builds).
    work = tempfile.mkdtemp(prefix="ddtree-e2e-", dir=params["env"].get("TMPDIR"))
    if len(work) <= MAX_TMPDIR_LEN:
        env["TMPDIR"] = work  # SGLang's IPC sockets and temp files go away with the work dir
    code = 1
    try:
        checks = run_checks(source, env, work)
        for key in ("deployed", "torch", "cuda", "kernel", "checks", "ddtree_utils", "error"):
            report[key] = checks.get(key, report.get(key))
        if checks["exit"] == 2 or not report["deployed"]:
            report["error"] = report["error"] or "bundle not deployed"
            code = 2
            return
        report["device"] = _device(bool(checks.get("cuda")))
        report["gpu_arch"] = _gpu_arch()
        models = write_models(work, params["block_size"])
        report["baseline"], want = run_baseline(params, models, env, work)
        if want is not None and params["bisect"] is not None:
            report["bisect"] = run_bisect(params, models, env, work, want)
        elif want is not None:
            for budget in params["budgets"]:
                for graphs in params["graphs"]:
                    run = run_ddtree(params, models, env, work, budget, graphs, want)
                    report["runs"].append(run)
                    if graphs == "on":
                        report["graph_capture"][str(budget)] = bool(run["verify_cuda_graph_captured"])
        else:
            report["error"] = "the target alone did not serve: %s" % report["baseline"]["error"]
        bisected = report.get("bisect")
        report["ok"] = (
            (bisected is not None or bool(report["runs"]))
            and all(r["ok"] for r in report["runs"])
            and all(c.get("ok") for c in report["checks"].values())
            and report["error"] is None
        )
        code = 0 if report["ok"] else 1
    except (KeyboardInterrupt, Interrupted):
        report["error"] = "interrupted"
        code = 130
    except Exception as exc:  # a bug or a broken host: reported, never a traceback alone
        report["error"] = "%s: %s" % (type(exc).__name__, exc)
        code = 1
    finally:
        report["work_dir"] = work if params["keep"] else None
        if not params["keep"]:
            shutil.rmtree(work, ignore_errors=True)
        _emit(report, start, code)


if __name__ == "__main__":
    main(sys.argv[1:])
