"""EngineArgs: every engine knob, named as in vLLM, with the CLI flags that set them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.arg_types import positive_int
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.cpu_cores import check_cpu_list, rank_cpu_cores

DEFAULT_MODEL_PATH = Path(__file__).parents[1] / "assets" / "default_model"
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
_DTYPES = ("float32", "bfloat16", "float16")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def parse_size(text: str | int) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1.5g"`` or a plain byte count."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _size(text: str) -> int:
    """argparse type for a byte size (one-line error)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


#: The engine flags after ``--model``, in ``--help`` order (``add_argument`` keywords but the
#: default, which is the ``EngineArgs`` field's).
_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--tokenizer", dict(help="tokenizer directory (default: the model's)")),
    (
        "--dtype",
        dict(
            choices=["auto", *_DTYPES],
            help="weights and activations dtype (auto: the checkpoint's on GPU, float32 on CPU)",
        ),
    ),
    ("--seed", dict(type=int, help="random seed for sampling")),
    ("--device", dict(choices=["auto", "cpu", "cuda"])),
    (
        "--max-model-len",
        dict(
            type=positive_int, help="context length (default: the model's max_position_embeddings)"
        ),
    ),
    ("--block-size", dict(type=positive_int, help="tokens per KV cache block")),
    (
        "--kv-cache-memory",
        dict(
            type=_size,
            help="KV cache size, e.g. 2GiB (default: 1GiB on CPU, --gpu-memory-utilization on GPU)",
        ),
    ),
    (
        "--num-gpu-blocks-override",
        dict(
            type=positive_int, help="exact number of KV cache blocks (overrides --kv-cache-memory)"
        ),
    ),
    ("--gpu-memory-utilization", dict(type=float)),
    (
        "--enable-prefix-caching",
        dict(action=argparse.BooleanOptionalAction, help="reuse the KV of shared prompt prefixes"),
    ),
    ("--prefix-caching-hash-algo", dict(choices=["xxh3_128", "sha256"])),
    ("--max-num-seqs", dict(type=positive_int, help="most requests in one batch")),
    (
        "--max-num-batched-tokens",
        dict(type=positive_int, help="token budget of one step (prefill chunks + decodes)"),
    ),
    ("--enable-chunked-prefill", dict(action=argparse.BooleanOptionalAction)),
    ("--scheduling-policy", dict(choices=["fcfs", "priority"])),
    (
        "--attention-backend",
        dict(choices=["torch", "triton"], help="default: torch on CPU, triton on CUDA"),
    ),
    (
        "--enforce-eager",
        dict(
            action="store_true",
            help="no kernels compiled at startup (CPU: attention gathers blocks and runs SDPA "
            "instead of the compiled paged decode and prefill kernels; norms, activations, "
            "RoPE, one-row projections and the greedy argmax run as torch ops)",
        ),
    ),
    (
        "--retune-kernels",
        dict(
            action="store_true",
            help="time again which of two equivalent CPU kernels each fp32 product takes "
            "(oneDNN or MKL, the LM head's layouts) and rewrite the per-machine file that "
            "keeps the choices (also $PAGEDKV_RETUNE_KERNELS=1); without it a start reads "
            "the file, so restarts give the same outputs",
        ),
    ),
    (
        "--cpu-cores",
        dict(
            metavar="LIST",
            help="run this instance's threads on these cores only, as taskset writes them "
            "(e.g. 0-3,6), with one torch thread per core; give instances on one host "
            "disjoint lists. With --tensor-parallel-size N: one list per rank (0-3|4-7), or "
            "one list cut into N equal runs (by default this process's cores are). Overrides "
            "$VLLM_CPU_OMP_THREADS_BIND (vLLM's: a list, all or auto = no binding). An "
            "instance warns when another pagedkv instance on this host may run on its cores",
        ),
    ),
    (
        "--tensor-parallel-size",
        dict(
            type=positive_int,
            short="-tp",
            help="shard the model across this many ranks (worker processes, rank 0 in the "
            "engine's), Megatron style: attention heads, KV heads and MLP features split, "
            "the vocabulary too; each rank on its own cores (--cpu-cores)",
        ),
    ),
    (
        "--kv-transfer-config",
        dict(
            type=_json_dict,
            help="KV connector config as JSON, e.g. "
            '\'{"kv_connector":"P2pConnector","kv_role":"kv_producer"}\'',
        ),
    ),
    (
        "--kv-offloading-size",
        dict(
            type=float,
            metavar="GiB",
            help="offload KV cache blocks to a host memory tier of this many GiB (vLLM's); "
            "with --kv-transfer-config, both connectors run (a MultiConnector)",
        ),
    ),
    ("--kv-offloading-backend", dict(choices=["native"], help="what offloads the KV")),
    (
        "--generation-config",
        dict(
            metavar="{auto,vllm,DIR}",
            help="sampling defaults for requests that do not set them: auto (the model's "
            "generation_config.json), vllm (vLLM's own: temperature 1, ...) or a directory",
        ),
    ),
    (
        "--kv-events-config",
        dict(
            type=_json_dict,
            help="publish KV cache events (vLLM's), e.g. "
            '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
            '"endpoint":"tcp://127.0.0.1:5557","replay_endpoint":"tcp://127.0.0.1:5558"}\'',
        ),
    ),
)


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxh3_128"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    enforce_eager: bool = False
    retune_kernels: bool = False
    kv_transfer_config: dict | None = field(default=None)
    #: GiB of host memory for offloaded KV blocks (``--kv-offloading-size``).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    generation_config: str = "auto"
    kv_events_config: dict | None = field(default=None)
    #: ``--cpu-cores``: a core list such as ``"0-3,6"`` (None: ``VLLM_CPU_OMP_THREADS_BIND``);
    #: with several ranks, one per rank (``"0-3|4-7"``) or one to cut (``rank_cpu_cores``).
    cpu_cores: str | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        """Range checks that need no model (those that do run when the engine loads it)."""

        def fail(name: str, requirement: str) -> None:
            raise ValueError(f"{name} {requirement}, got {getattr(self, name)!r}")

        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail(name, "must be an integer >= 1")
        for name, low in (
            ("max_model_len", 1),
            ("num_gpu_blocks_override", 2),
            ("kv_cache_memory", 1),
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                fail(name, f"must be an integer >= {low} (or None for the default)")
        fraction = self.gpu_memory_utilization
        if not (isinstance(fraction, int | float) and 0 < fraction <= 1):
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.dtype not in ("auto", *_DTYPES):
            fail("dtype", f"must be one of auto, {', '.join(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            fail("device", "must be one of auto, cpu, cuda")
        if self.scheduling_policy not in ("fcfs", "priority"):
            fail("scheduling_policy", "must be fcfs or priority")
        if not self.generation_config:
            fail("generation_config", "must be auto, vllm or a directory")
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int | float)):
            fail("kv_offloading_size", "must be a number of GiB > 0 (or None)")
        if size is not None and not size > 0:
            fail("kv_offloading_size", "must be a number of GiB > 0 (or None)")
        if self.kv_offloading_backend != "native":
            fail("kv_offloading_backend", "must be native")
        if self.cpu_cores is not None:
            if not isinstance(self.cpu_cores, str):
                fail("cpu_cores", "must be a core list like 0-3,6 (a string)")
            try:
                for part in (
                    self.cpu_cores.split("|") if self.tensor_parallel_size > 1 else [self.cpu_cores]
                ):
                    check_cpu_list(part)
            except ValueError as e:
                fail("cpu_cores", f"must be a core list like 0-3,6 ({e})")

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL_PATH

    def effective_kv_transfer_config(self) -> dict | None:
        """The KV connector the engine runs: ``kv_transfer_config``, an OffloadingConnector
        for ``kv_offloading_size`` (a host tier), or both under a MultiConnector: the tiers
        first, so that a request loads what its tiers hold and the rest from the user's
        connector (P2P: from P)."""
        if self.kv_offloading_size is None:
            return self.kv_transfer_config
        offloading = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [{"medium": "cpu", "size_gib": self.kv_offloading_size}]
            },
        }
        user = self.kv_transfer_config
        if user is None:
            return offloading
        if user.get("kv_connector") == "MultiConnector":  # one more child
            children = (user.get("kv_connector_extra_config") or {}).get("connectors")
            extra = {"connectors": [offloading, *(children or [])]}
            return {**user, "kv_connector_extra_config": extra}
        multi = {"kv_connector": "MultiConnector", "kv_role": user.get("kv_role")}
        if "engine_id" in user:
            multi["engine_id"] = user["engine_id"]
        return {**multi, "kv_connector_extra_config": {"connectors": [offloading, user]}}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
        """The ``engine`` flags (``_FLAGS``); each default is the field's."""
        g = parser.add_argument_group("engine")
        help_model = "Hugging Face model directory (default: the built-in model)"
        if model_positional:
            g.add_argument("model", nargs="?", default=None, help=help_model)
            g.add_argument(
                "--model", dest="model_option", default=None, help="the same, as a flag (vLLM's)"
            )
        else:
            g.add_argument("--model", default=None, help=help_model)
        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        for flag, kwargs in _FLAGS:
            kwargs = dict(kwargs)
            names = [kwargs.pop("short"), flag] if "short" in kwargs else [flag]
            g.add_argument(*names, default=defaults[flag[2:].replace("-", "_")], **kwargs)

    def create_worker_config(self) -> WorkerConfig:
        """What the model runner reads: the fields of ``WorkerConfig``, named as here."""
        names = {f.name for f in dataclasses.fields(WorkerConfig)} - {"model_path"}
        return WorkerConfig(self.model_path, **{name: getattr(self, name) for name in names})

    def create_worker_configs(self) -> list[WorkerConfig]:
        """Each tensor-parallel rank's: the same but for its own cores (``rank_cpu_cores``)."""
        config = self.create_worker_config()
        cores = rank_cpu_cores(self.cpu_cores, self.tensor_parallel_size)
        return [dataclasses.replace(config, cpu_cores=rank_cores) for rank_cores in cores]

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Raises ValueError (one line) for a value out of range."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values["model"] = model_arg(args)
        return cls(**values)


def model_arg(args: argparse.Namespace) -> str | None:
    """``serve`` takes the model as ``MODEL`` or ``--model MODEL`` (not two different ones)."""
    positional, option = args.model, getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"the model is given twice: {positional!r} and --model {option!r}")
    return positional if positional is not None else option
