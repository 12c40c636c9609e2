#!/usr/bin/env python3
"""Train pagedkv's built-in default model from the Python standard library.

The model that ships in ``pagedkv/assets/default_model/`` is a tiny Llama-architecture
causal LM trained from scratch, on CPU, on text every machine already has offline: the
``*.py`` files of the running interpreter's standard library. It is not a useful assistant;
it exists so that ``pagedkv generate "def fibonacci(n):"`` prints readable, plausible Python
on a fresh machine without downloads, and so that the engine has a small real model for tests.

Pipeline (all deterministic for a given Python installation, seed and step count):

1. Corpus: ``sysconfig.get_paths()["stdlib"]/**/*.py``, sorted by relative path, skipping
   test/tests/idlelib/lib2to3/site-packages plus encodings/ (codec tables) and pydoc_data/
   (prose). Every ``--val-every``-th file is held out for validation. From each file, a
   chat-formatted copy of short documented functions (docstring -> code) is also added, so the
   ``<|user|>``/``<|assistant|>`` tokens of the chat template are trained.
2. Tokenizer: byte-level BPE (``tokenizers``), saved so ``AutoTokenizer`` loads it as a fast
   tokenizer, with a Jinja chat template in ``tokenizer_config.json``. No BOS is added on
   encode, and decoding round-trips any text exactly.
3. Model: ``transformers.LlamaForCausalLM`` trained in fp32 with AdamW + warmup/cosine.
4. Output: Hugging Face files in ``--out``; a report and loss plot in ``--docs-dir``.

Example::

    python scripts/train_default_model.py                 # the shipped model (fixed steps)
    python scripts/train_default_model.py --steps 20 --out /tmp/m --docs-dir /tmp/m  # smoke
    python scripts/train_default_model.py --minutes 10    # time-budgeted (not bit-reproducible)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

EOS = "<|endoftext|>"  # BOS, EOS, document separator and end of a chat turn
PAD = "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [EOS, PAD, *ROLE_TOKENS.values()]  # ids 0..4, in this order

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "pydoc_data"}

# Rendered: "<|endoftext|><|user|>\n{content}<|endoftext|><|assistant|>\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHAT_USER_PREFIX = "Write a Python function: "

POST_TRAIN_RESERVE_S = 180  # final evaluation, saving, samples, plot (slack for a busy CPU)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def log(msg: str, t0: float) -> None:
    print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def collect_files(stdlib: Path) -> list[Path]:
    files = []
    for p in stdlib.rglob("*.py"):
        rel = p.relative_to(stdlib)
        if set(rel.parts[:-1]) & SKIP_DIRS:
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def chat_examples(src: str, max_code_chars: int) -> list[tuple[str, str]]:
    """(instruction, code) pairs: first docstring paragraph -> the function without it."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    lines = src.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2:
            continue
        first = doc.split("\n\n")[0].replace("\n", " ").strip()
        first = " ".join(first.split())
        if not 10 <= len(first) <= 300:
            continue
        d = node.body[0]
        if d.lineno <= node.lineno:  # docstring on the def line
            continue
        body = lines[node.lineno - 1 : d.lineno - 1] + lines[d.end_lineno : node.end_lineno]
        code = textwrap.dedent("".join(body)).strip("\n") + "\n"
        if len(code) > max_code_chars:
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            continue
        out.append((CHAT_USER_PREFIX + first, code))
    return out


def load_corpus(args, t0):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_files(stdlib)
    h = hashlib.sha256()
    split = {"train": {"code": [], "chat": []}, "val": {"code": [], "chat": []}}
    n_files = {"train": 0, "val": 0}
    for i, p in enumerate(files):
        try:
            src = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = p.relative_to(stdlib).as_posix()
        h.update(rel.encode() + b"\0" + src.encode() + b"\0")
        name = "val" if i % args.val_every == args.val_every - 1 else "train"
        n_files[name] += 1
        split[name]["code"].append(src)
        split[name]["chat"].extend(chat_examples(src, args.max_chat_code_chars))
    info = {
        "stdlib": str(stdlib),
        "python": platform.python_version(),
        "n_files": n_files,
        "chars": {k: sum(map(len, v["code"])) for k, v in split.items()},
        "chat_examples": {k: len(v["chat"]) for k, v in split.items()},
        "sha256": h.hexdigest(),
    }
    log(f"corpus: {info}", t0)
    return split, info


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level pre-tokenization: no prefix space, runs of spaces (indentation)
    # kept as their own pieces; the ByteLevel decoder inverts it exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save_tokenizer(tok, out: Path, seq_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    # Written by hand (not by save_pretrained) so that transformers 4.x and 5.x both load it:
    # a class name both know, the chat template inline, and no BOS/EOS added on encode.
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": seq_len,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    smap = {
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def check_tokenizer(out: Path, code_samples: list[str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast, type(tok)
    tok.model_max_length = 10**9  # whole files are encoded below; silence the length warning
    probes = [
        "def f(x):\n    return  x + 1 ,  \n\n\t# tab\r\n  trailing   \n",
        "s = 'caf\u00e9 \u2192 \U0001f600'  #  unicode\n",
        "    indented first line\n\n\n",
        " leading space",
        "",
    ]
    for text in probes + code_samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, f"round trip failed for {text[:60]!r}"
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)
    msgs = [{"role": "user", "content": "Return the n-th Fibonacci number."}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == f"{EOS}<|user|>\n{msgs[0]['content']}{EOS}<|assistant|>\n", rendered
    assert tok.bos_token_id == 0 and tok.eos_token_id == 0 and tok.pad_token_id == 1


def encode_stream(tok, split) -> list[int]:
    """One token stream: each document is preceded by <|endoftext|> (id 0)."""
    eos, user, asst = (
        0,
        tok.token_to_id(ROLE_TOKENS["user"]),
        tok.token_to_id(ROLE_TOKENS["assistant"]),
    )
    ids: list[int] = []
    for enc in tok.encode_batch(split["code"]):
        ids.append(eos)
        ids.extend(enc.ids)
    chat = split["chat"]
    users = tok.encode_batch(["\n" + u for u, _ in chat])
    codes = tok.encode_batch(["\n" + c for _, c in chat])
    for u, c in zip(users, codes, strict=True):
        ids += [eos, user, *u.ids, eos, asst, *c.ids, eos]
    return ids


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def make_config(args, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        use_cache=True,
    )


def lr_at(progress: float, args) -> float:
    """Linear warmup then cosine decay to lr*min_lr_ratio; progress in [0, 1]."""
    warm = args.warmup_frac
    if progress < warm:
        return args.lr * progress / warm
    p = min(1.0, (progress - warm) / (1 - warm))
    r = args.min_lr_ratio
    return args.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p)))


def evaluate(model, windows, batch_size):
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            w = windows[i : i + batch_size]
            logits = model(input_ids=w[:, :-1]).logits
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return total / count


def to_windows(ids, seq_len):
    import torch

    t = torch.tensor(ids, dtype=torch.long)
    n = (len(t) - 1) // seq_len
    # windows of seq_len+1 tokens overlapping by one (input = w[:-1], target = w[1:])
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return t[idx]


def batch_order(n_windows, batch_size, seed):
    """Infinite, deterministic stream of window-index batches: a fresh permutation per epoch."""
    import torch

    g = torch.Generator().manual_seed(seed)
    epoch = 0
    while True:
        perm = torch.randperm(n_windows, generator=g)
        for i in range(0, n_windows - batch_size + 1, batch_size):
            yield epoch, perm[i : i + batch_size]
        epoch += 1


def train(args, cfg, train_ids, val_ids, t0):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.3f}M parameters (tied embeddings)", t0)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    train_w = to_windows(train_ids, args.seq_len)
    val_w = to_windows(val_ids, args.seq_len)
    g = torch.Generator().manual_seed(args.seed + 1)
    val_probe = val_w[torch.randperm(len(val_w), generator=g)[: args.eval_windows]]
    train_probe = train_w[torch.randperm(len(train_w), generator=g)[: args.eval_windows]]
    log(
        f"data: {len(train_w)} train windows, {len(val_w)} val windows of {args.seq_len} tokens; "
        f"batch {args.batch_size} x {args.seq_len} = {args.batch_size * args.seq_len} tokens/step",
        t0,
    )

    hist = {"step": [], "train": [], "val_step": [], "val": [], "lr": []}
    # Progress through the LR schedule (0 -> 1) is normally step/steps, which makes the run a
    # pure function of its arguments. With --minutes it follows the clock from the start. With
    # --deadline-minutes, if the recent pace (evaluations included) projects past the time left
    # before the deadline, the rest of the schedule is compressed onto the clock from then on: a
    # busy machine gets fewer steps but still anneals and finishes in time. Such a run is not
    # bit-reproducible; "time_limited" records that it happened.
    t_train = time.time()
    if args.minutes:
        budget_s = args.minutes * 60
    elif args.deadline_minutes:
        budget_s = args.deadline_minutes * 60 - (t_train - t0) - POST_TRAIN_RESERVE_S
        if budget_s <= 0:
            raise SystemExit("--deadline-minutes leaves no time for training")
    else:
        budget_s = None
    total_steps = args.steps
    time_limited = bool(args.minutes)
    p0, t_switch = 0.0, 0.0  # schedule progress and train time when the clock took over
    stamps: list[float] = []  # train time at the end of each step
    ema = None
    order = batch_order(len(train_w), args.batch_size, args.seed)
    step = 0
    epoch = 0
    while True:
        now = time.time() - t_train
        if not time_limited:
            progress = step / total_steps
            # Judge the pace over the last quarter of the run so far, and only after a tenth
            # of it: a short stall (another job, the first slow steps) should not give up
            # reproducibility. Switching late is safe; the rest of the schedule is compressed.
            if budget_s is not None and step > max(50, total_steps // 10):
                k = max(50, step // 4)
                pace = (stamps[-1] - stamps[-1 - k]) / k
                if now + (total_steps - step) * pace > budget_s:
                    time_limited, p0, t_switch = True, progress, now
                    log(
                        f"WARNING: at {pace:.2f}s/step the {total_steps} steps would overrun "
                        f"--deadline-minutes; from step {step} the schedule follows the clock",
                        t0,
                    )
        if time_limited:
            progress = p0 + (1 - p0) * (now - t_switch) / (budget_s - t_switch)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        epoch, idx = next(order)
        w = train_w[idx]
        logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        li = loss.item()
        stamps.append(time.time() - t_train)
        ema = li if ema is None else 0.95 * ema + 0.05 * li
        hist["step"].append(step)
        hist["train"].append(li)
        hist["lr"].append(lr)
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_train
            log(
                f"step {step:5d} epoch {epoch} lr {lr:.2e} loss {li:.4f} (ema {ema:.4f}) "
                f"{el / step:.3f}s/step",
                t0,
            )
        if step % args.eval_every == 0:
            vl = evaluate(model, val_probe, args.batch_size)
            hist["val_step"].append(step)
            hist["val"].append(vl)
            log(f"step {step:5d} val loss {vl:.4f} (probe of {len(val_probe)} windows)", t0)

    train_s = time.time() - t_train
    if not hist["val_step"] or hist["val_step"][-1] != step:
        vl = evaluate(model, val_probe, args.batch_size)
        hist["val_step"].append(step)
        hist["val"].append(vl)
    final = {
        "steps": step,
        "epochs": step * args.batch_size / max(1, len(train_w)),
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_seconds": train_s,
        "sec_per_step": train_s / max(1, step),
        "train_loss_ema": ema,
        "train_loss": evaluate(model, train_probe, args.batch_size),
        "val_loss": evaluate(model, val_w, args.batch_size),  # the whole held-out set
        "val_tokens": int(val_w[:, 1:].numel()),
        "n_params": n_params,
        "time_limited": time_limited,
    }
    log(
        f"trained {step} steps in {train_s / 60:.1f} min; train loss {final['train_loss']:.4f}, "
        f"val loss {final['val_loss']:.4f} on {final['val_tokens']} held-out tokens",
        t0,
    )
    return model, hist, final


def save_model(model, cfg, out: Path, dtype_name: str):
    import torch
    from transformers import GenerationConfig

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = model.to(dtype)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    # Make config.json readable by transformers 4.x (top-level rope_theta, torch_dtype) as
    # well as 5.x (rope_parameters, dtype).
    cpath = out / "config.json"
    c = json.loads(cpath.read_text())
    rope = c.get("rope_parameters") or {}
    c["rope_theta"] = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    c["rope_scaling"] = None
    c["torch_dtype"] = dtype_name
    c["dtype"] = dtype_name
    c["architectures"] = ["LlamaForCausalLM"]
    cpath.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    gen = GenerationConfig(
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
    )
    gen.save_pretrained(out)
    model.to(torch.float32)


def generate_samples(out: Path, seed: int, max_new_tokens: int):
    """Reload from disk with the Auto classes (what a user of the files would do)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    samples = []
    prompts = [(p, p) for p in SAMPLE_PROMPTS]
    chat = [{"role": "user", "content": CHAT_USER_PREFIX + "Return the n-th Fibonacci number."}]
    prompts.append(
        (
            "chat: " + chat[0]["content"],
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
        )
    )
    for label, text in prompts:
        ids = torch.tensor([tok.encode(text)])
        for mode in ("greedy", "temperature 0.7"):
            torch.manual_seed(seed)
            kwargs = (
                {"do_sample": False}
                if mode == "greedy"
                else {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0}
            )
            with torch.no_grad():
                o = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                    **kwargs,
                )
            completion = tok.decode(o[0, ids.shape[1] :], skip_special_tokens=True)
            samples.append({"prompt": label, "mode": mode, "text": text, "completion": completion})
    return samples


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def plot_losses(hist, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, tr = hist["step"], hist["train"]
    k = max(25, len(tr) // 40)
    smooth = [
        sum(tr[max(0, i - k + 1) : i + 1]) / len(tr[max(0, i - k + 1) : i + 1])
        for i in range(len(tr))
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, tr, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", lw=1.6, label=f"train ({k}-step mean)")
    ax.plot(
        hist["val_step"],
        hist["val"],
        "o-",
        color="tab:orange",
        ms=3.5,
        lw=1.6,
        label="validation (held-out files)",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=max(0.0, min(min(tr), min(hist["val"])) - 0.3), top=min(9.0, max(tr)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(
    args,
    path: Path,
    out: Path,
    plot_path: Path,
    cfg,
    corpus,
    tok_info,
    final,
    samples,
    total_s,
    weights_sha,
):
    size = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    total = sum(size.values())
    bpb = final["val_loss"] / math.log(2) / tok_info["val_bytes_per_token"]
    rel_out = os.path.relpath(out, REPO_ROOT) if out.is_relative_to(REPO_ROOT) else str(out)
    rel_plot = os.path.relpath(plot_path, path.parent)
    cmd = "python scripts/train_default_model.py " + " ".join(sys.argv[1:])
    L = []
    L.append("# The built-in default model\n")
    L.append(
        "`pagedkv/assets/default_model/` holds a tiny Llama-architecture causal LM trained from "
        "scratch on the Python standard library, so pagedkv works offline out of the box and the "
        "engine has a small real model for tests. It writes plausible-looking Python; it does not "
        "follow instructions and its code is usually wrong. It is generated by "
        "`scripts/train_default_model.py`; this page is written by that script.\n"
    )
    L.append("## How it was made\n")
    L.append(f"- Command: `{cmd.strip()}`")
    L.append(
        f"- Seed {args.seed}; torch {__import__('torch').__version__}, transformers "
        f"{__import__('transformers').__version__}, tokenizers "
        f"{__import__('tokenizers').__version__}, Python {platform.python_version()}, "
        f"{args.threads} CPU threads ({platform.processor() or platform.machine()})."
    )
    L.append(
        f"- Total wall time {total_s / 60:.1f} min (training {final['train_seconds'] / 60:.1f}"
        f" min, {final['sec_per_step']:.2f} s/step)."
        + (
            " **The LR schedule followed wall time (`--minutes`, or a slow machine hit"
            " `--deadline-minutes`), so this run is not bit-reproducible.**"
            if final["time_limited"]
            else ""
        )
    )
    L.append("")
    L.append("### Data\n")
    nf, ch = corpus["n_files"], corpus["chars"]
    L.append(
        f"The `*.py` files under `{corpus['stdlib']}` (Python {corpus['python']}), sorted by "
        f"relative path, skipping directories named {', '.join(sorted(SKIP_DIRS))} "
        "(tests, IDLE, 2to3, third-party packages, codec tables, pydoc's prose topics). "
        f"Every {args.val_every}th file (index % {args.val_every} == {args.val_every - 1}) is held "
        f"out for validation: {nf['train']} train files ({ch['train'] / 1e6:.2f} M chars), "
        f"{nf['val']} validation files ({ch['val'] / 1e6:.2f} M chars). Corpus sha256 "
        f"`{corpus['sha256'][:16]}…` (another Python version gives another corpus and model)."
    )
    L.append("")
    L.append(
        f"In addition, every documented function whose code is at most {args.max_chat_code_chars} "
        'characters becomes a chat example, `<|user|>` = "' + CHAT_USER_PREFIX + '" + the first '
        "docstring paragraph, `<|assistant|>` = the function without its docstring "
        f"({corpus['chat_examples']['train']} train / {corpus['chat_examples']['val']} validation "
        "examples, from the same split of files), so the chat-template tokens are trained."
    )
    L.append("")
    L.append(
        f"Token stream: every document is preceded by `<|endoftext|>`; train "
        f"{tok_info['train_tokens']:,} tokens, validation {tok_info['val_tokens']:,} tokens. It is "
        f"cut into non-overlapping windows of {args.seq_len}+1 tokens; each epoch visits them in a "
        f"fresh seeded permutation."
    )
    L.append("")
    L.append("### Tokenizer\n")
    L.append(
        f"Byte-level BPE (`tokenizers`), vocabulary {tok_info['vocab_size']} including the "
        f"special tokens {', '.join(f'`{t}` = {i}' for i, t in enumerate(SPECIAL_TOKENS))}. "
        "GPT-2 byte-level pre-tokenizer without prefix space and the ByteLevel decoder, so "
        "`tokenizer.decode(tokenizer.encode(text)) == text` for any text (checked by the script "
        "on all validation files). Nothing is added on encode (no automatic BOS, like GPT-2/Qwen); "
        "`<|endoftext|>` is bos, eos and the document separator, `<|pad|>` is pad. "
        f"{tok_info['val_bytes_per_token']:.2f} UTF-8 bytes per token on the validation files. "
        "Loads with `AutoTokenizer.from_pretrained` as a fast tokenizer "
        "(`PreTrainedTokenizerFast`)."
    )
    L.append("")
    L.append("Chat template (in `tokenizer_config.json`):\n")
    L.append("```jinja\n" + CHAT_TEMPLATE + "\n```\n")
    L.append(
        '`apply_chat_template([{"role": "user", "content": "hi"}], '
        "add_generation_prompt=True)` renders `<|endoftext|><|user|>\\nhi<|endoftext|>"
        "<|assistant|>\\n`; the assistant's turn ends with `<|endoftext|>` (= eos)."
    )
    L.append("")
    L.append("### Architecture\n")
    L.append("| field | value |\n|---|---|")
    rows = [
        ("architecture", "`LlamaForCausalLM` (RMSNorm, SwiGLU MLP, RoPE, GQA)"),
        ("vocab_size", cfg.vocab_size),
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("num_hidden_layers", cfg.num_hidden_layers),
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("head_dim", cfg.head_dim),
        ("max_position_embeddings (training context)", cfg.max_position_embeddings),
        ("rope_theta", args.rope_theta),
        ("rms_norm_eps", cfg.rms_norm_eps),
        ("tie_word_embeddings", "true (no `lm_head.weight` in the file)"),
        ("bos / eos / pad token id", "0 / 0 / 1"),
        ("parameters", f"{final['n_params']:,}"),
        ("stored dtype", args.save_dtype),
    ]
    for k, v in rows:
        L.append(f"| {k} | {v} |")
    L.append("")
    L.append("### Training\n")
    L.append(
        f"fp32 on CPU, `torch.set_num_threads({args.threads})`. AdamW (betas 0.9/0.95, weight "
        f"decay {args.weight_decay} on matrices and embeddings), peak lr {args.lr}, linear warmup "
        f"over the first {args.warmup_frac:.0%} then cosine decay to {args.min_lr_ratio:.0%} of "
        f"peak, grad-norm clip {args.grad_clip}, batch {args.batch_size} x {args.seq_len} tokens. "
        + (f"Schedule driven by wall time (`--minutes {args.minutes}`). " if args.minutes else "")
    )
    L.append("")
    L.append("| | |\n|---|---|")
    L.append(f"| optimizer steps | {final['steps']:,} |")
    L.append(f"| tokens seen | {final['tokens_seen']:,} ({final['epochs']:.2f} epochs) |")
    L.append(f"| training wall time | {final['train_seconds'] / 60:.1f} min |")
    L.append(f"| total script wall time | {total_s / 60:.1f} min |")
    L.append(
        f"| final train loss (eval mode, {args.eval_windows} train windows) | "
        f"{final['train_loss']:.4f} nats/token |"
    )
    L.append(f"| final train loss (EMA of last steps) | {final['train_loss_ema']:.4f} |")
    L.append(
        f"| **final validation loss** (all {final['val_tokens']:,} held-out tokens) | "
        f"**{final['val_loss']:.4f}** nats/token "
        f"(perplexity {math.exp(final['val_loss']):.1f}, {bpb:.3f} bits/byte) |"
    )
    L.append("")
    L.append(f"![train and validation loss]({rel_plot})\n")
    L.append("### Files\n")
    L.append(f"`{rel_out}/` ({total / 1e6:.2f} MB):\n")
    for name, s in size.items():
        L.append(f"- `{name}` — {s:,} bytes")
    L.append(f"\n`model.safetensors` sha256: `{weights_sha}`\n")
    L.append("### Reproducibility\n")
    L.append(
        "Deterministic given the same Python stdlib (corpus), seed, `--steps`, thread count, "
        "library versions and CPU instruction set: the corpus is a sorted file list, BPE training "
        "is deterministic, the initial weights come from `torch.manual_seed(seed)`, the data order "
        "from a seeded `torch.Generator`, and CPU kernels with a fixed thread count are "
        "deterministic. Two runs with the "
        "same arguments on the same machine produce a bit-identical `model.safetensors` (compare "
        "the sha256 printed at the end). A different CPU (e.g. AVX2 vs AVX-512 kernels), thread "
        "count or torch version can change floating-point rounding and hence the weights. "
        "`--minutes` (wall-time schedule) and a triggered `--deadline-minutes` are not "
        "reproducible, because the schedule and number of steps then depend on speed."
    )
    L.append("")
    L.append("### Samples\n")
    L.append(
        f"Reloaded from disk with `AutoModelForCausalLM`/`AutoTokenizer`, {args.sample_tokens} new "
        f"tokens, sampling seed {args.seed}; `temperature 0.7` is plain temperature sampling "
        "(no top-k/top-p). Output stops early at `<|endoftext|>`.\n"
    )
    for s in samples:
        L.append(f"**{s['prompt']!r}**, {s['mode']}:\n")
        body = (
            s["text"] + s["completion"] if not s["prompt"].startswith("chat") else (s["completion"])
        )
        L.append("```python\n" + body.replace("```", "`\u200b``").rstrip("\n") + "\n```\n")
    L.append("## Using it\n")
    L.append(
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'tok = AutoTokenizer.from_pretrained("{rel_out}")\n'
        f'model = AutoModelForCausalLM.from_pretrained("{rel_out}")\n'
        'ids = tok("def fibonacci(n):", return_tensors="pt").input_ids\n'
        "print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))\n```\n"
    )
    L.append(
        "Note for loaders: transformers 5 keeps RoPE settings in `rope_parameters`; `config.json` "
        "also carries a top-level `rope_theta` (and `torch_dtype`) so transformers 4.x and simple "
        "JSON readers see the same values.\n"
    )
    path.write_text("\n".join(L))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where the default is None (the help text explains it)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="train_default_model.py",
        description=(
            "Train pagedkv's built-in default model (a tiny Llama-architecture LM) from the "
            "Python standard library, on CPU, and write it in Hugging Face format together with "
            "a report (docs/default_model.md) and a loss plot. The defaults reproduce the model "
            "that ships in pagedkv/assets/default_model/ in under 30 minutes on 2 CPU cores."
        ),
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for config.json, model.safetensors and tokenizer files "
        "(default: <repo>/pagedkv/assets/default_model)",
    )
    g.add_argument(
        "--docs-dir",
        type=Path,
        default=None,
        help="directory for default_model.md and default_model_loss.png (default: <repo>/docs)",
    )
    g.add_argument(
        "--save-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the stored weights (training is always fp32)",
    )
    g = p.add_argument_group("length of training (pick one)")
    x = g.add_mutually_exclusive_group()
    x.add_argument(
        "--steps",
        type=int,
        default=4000,
        help="optimizer steps; fixed steps give bit-reproducible weights",
    )
    x.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train for this many wall-clock minutes instead, with the LR schedule "
        "driven by elapsed time (fits any machine, but not reproducible)",
    )
    g.add_argument(
        "--deadline-minutes",
        type=float,
        default=27.0,
        help="safety net for busy machines: if fixed --steps would run the whole script past "
        "this, the LR schedule follows the clock instead and training ends early but annealed, "
        f"leaving {POST_TRAIN_RESERVE_S}s for evaluation and saving (0 disables; the report "
        "says when it happened)",
    )
    g = p.add_argument_group("reproducibility and hardware")
    g.add_argument("--seed", type=int, default=0, help="seed for init, data order and sampling")
    g.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary incl. specials")
    g.add_argument(
        "--val-every",
        type=int,
        default=20,
        help="hold out every N-th file (sorted order) for validation",
    )
    g.add_argument(
        "--max-chat-code-chars",
        type=int,
        default=800,
        help="longest function turned into a docstring->code chat example",
    )
    g = p.add_argument_group("model")
    g.add_argument("--hidden-size", type=int, default=192, help="model width")
    g.add_argument("--intermediate-size", type=int, default=512, help="SwiGLU MLP width")
    g.add_argument("--layers", type=int, default=6, help="decoder layers")
    g.add_argument("--heads", type=int, default=3, help="attention (query) heads")
    g.add_argument("--kv-heads", type=int, default=1, help="key/value heads (GQA)")
    g.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="training context, saved as max_position_embeddings",
    )
    g.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    g.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    g.add_argument("--warmup-frac", type=float, default=0.05, help="fraction of training")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", type=int, default=250, help="steps between val-probe evals")
    g.add_argument(
        "--eval-windows",
        type=int,
        default=48,
        help="windows in the periodic validation probe (the final val loss uses all)",
    )
    g.add_argument("--log-every", type=int, default=100, help="steps between log lines")
    g.add_argument("--sample-tokens", type=int, default=120, help="new tokens per sample")
    args = p.parse_args(argv)
    args.out = args.out or REPO_ROOT / "pagedkv" / "assets" / "default_model"
    args.docs_dir = args.docs_dir or REPO_ROOT / "docs"
    if args.minutes is not None:
        args.steps = None
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        p.error("hidden-size must divide by heads, and heads by kv-heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Idle OpenMP threads sleep instead of spinning. Same numerics; on a CPU shared with other
    # jobs this made steps 2-5x faster (spinning threads steal the core the other one needs).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    log(f"args: {vars(args)}", t0)

    out, docs = args.out.resolve(), args.docs_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # the output dir holds exactly what this run writes
        if stale.is_file():
            stale.unlink()

    split, corpus = load_corpus(args, t0)
    tok = train_tokenizer(split["train"]["code"], args.vocab_size)
    save_tokenizer(tok, out, args.seq_len)
    check_tokenizer(out, split["val"]["code"])
    log(f"tokenizer: vocab {tok.get_vocab_size()}, round trip OK on all validation files", t0)

    train_ids = encode_stream(tok, split["train"])
    val_ids = encode_stream(tok, split["val"])
    val_bytes = sum(len(s.encode()) for s in split["val"]["code"])
    val_code_tokens = sum(len(e.ids) for e in tok.encode_batch(split["val"]["code"]))
    tok_info = {
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "val_bytes_per_token": val_bytes / val_code_tokens,
    }
    log(f"tokens: {tok_info}", t0)

    cfg = make_config(args, tok.get_vocab_size())
    model, hist, final = train(args, cfg, train_ids, val_ids, t0)

    save_model(model, cfg, out, args.save_dtype)
    weights_sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    log(f"saved to {out}; model.safetensors sha256 {weights_sha}", t0)

    samples = generate_samples(out, args.seed, args.sample_tokens)
    for s in samples:
        print(
            f"----- {s['prompt']!r} ({s['mode']}) -----\n{s['text']}{s['completion']}\n", flush=True
        )

    plot_path = docs / "default_model_loss.png"
    title = (
        f"default model: {final['n_params'] / 1e6:.2f}M params, {final['steps']} steps, "
        f"{final['tokens_seen'] / 1e6:.1f}M tokens; final val {final['val_loss']:.3f}"
    )
    plot_losses(hist, plot_path, title)
    total_s = time.time() - t0
    write_report(
        args,
        docs / "default_model.md",
        out,
        plot_path,
        cfg,
        corpus,
        tok_info,
        final,
        samples,
        total_s,
        weights_sha,
    )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(
        f"done: {size / 1e6:.2f} MB in {out}; report {docs / 'default_model.md'}; "
        f"total wall time {total_s / 60:.1f} min",
        t0,
    )
    log(f"summary: {json.dumps({**final, 'weights_sha256': weights_sha, 'total_s': total_s})}", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
