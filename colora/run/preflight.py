"""What a run needs before its engine starts: the model directory, the device and dtype, the tasks
(built with their options, each split large enough for what the run draws from it), what vLLM would
refuse of the config only once it starts or serves (LoRA ranks, the scheduler's budgets, the model's
context against max_model_len and each job's prompts), an output directory it may write, and MPS for
the arms that use it.

Every check here needs no engine and creates nothing on failure: bad input is a `RunError` whose
message names the key or flag, the value and what to do. (What the config alone decides, such as
overlap.groups against the number of jobs, is checked when it loads: colora/config.py.) Once the checks
pass, the adapter-sync folders that killed runs left in /dev/shm are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from colora.config import Config, JobConfig
from colora.engine.adapters import SHM, AdapterSyncUnsupported, resolve
from colora.engine.vllm_args import VLLM_LORA_RANKS
from colora.environment import colora_home
from colora.models.base import ModelDirError, build_qwen3_shape, build_tiny, check_model_dir, load_tokenizer
from colora.models.qwen3_shapes import QWEN3_SHAPES, build_random_qwen3
from colora.models.smollm2 import build_smollm2
from colora.record.runlog import sha256_file
from colora.run import mps
from colora.run.mps import MpsDaemon, MpsShareError, MpsUnavailable
from colora.seeding import derive_seed
from colora.tasks import TaskError, get_task, task_dirs
from colora.training.sft_data import SftData, SftDataError, resolve_data_path

MPS_ARMS = ("mps", "overlap_mps")
# builtin:NAME -> its folder in colora's model cache. The folder names the builder's revision, so a
# changed builder builds afresh instead of serving a cache the old one made.
BUILTIN_MODELS = {"tiny": "tiny-r2", "qwen3-0.6b-shape": "qwen3-0.6b-shape", "qwen3-1.7b-shape": "qwen3-1.7b-shape",
                  "qwen3-4b-shape": "qwen3-4b-shape", "qwen3-8b-shape": "qwen3-8b-shape", "smollm2": "smollm2"}


class RunError(RuntimeError):
    """Bad input: a run that cannot start; the message says what is wrong and what to do."""


def resolve_model(spec: str, log: Callable[[str], None] = print) -> Path:
    """A model directory for `experiment.model`: a path, or builtin:NAME built once into the cache."""
    if not spec.startswith("builtin:"):
        try:
            return check_model_dir(spec)
        except ModelDirError as e:
            raise RunError(f"experiment.model: {e}") from None
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise RunError(f"experiment.model = {spec!r}: unknown builtin; accepted: "
                       + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))
    out = colora_home() / "models" / BUILTIN_MODELS[name]
    if (out / "config.json").exists():
        return out
    log(f"building {spec} into {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
    try:
        if name == "tiny":
            build_tiny(tmp)
        elif name == "qwen3-0.6b-shape":
            build_qwen3_shape(tmp)
        elif name in QWEN3_SHAPES:
            build_random_qwen3(tmp, QWEN3_SHAPES[name])
        else:
            shutil.rmtree(tmp)
            build_smollm2(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            # another process (a timeslice arm's other tenant, a parallel sweep) finished the same
            # build first: its complete folder serves, ours is dropped
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_device(cfg: Config) -> tuple[str, str]:
    """(device, dtype) for `experiment.device` and `experiment.dtype`, "auto" resolved."""
    device = cfg.experiment.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("experiment.device = 'cuda' but no CUDA device is available")
    dtype = cfg.experiment.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def torch_dtype(name: str):
    """The torch dtype of a resolved `experiment.dtype` ("float32", "bfloat16", "float16")."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tasks(jobs: tuple[JobConfig, ...]) -> dict:
    """Each grpo job's task, built with its options (sft jobs have data instead: `load_sft_data`)."""
    tasks = {}
    for i, j in enumerate(jobs):
        if j.kind == "sft":
            continue
        try:
            tasks[j.name] = get_task(j.task, **j.task_options)
        except Exception as e:
            raise RunError(f"jobs.{i}.task = {j.task!r} (job {j.name!r}): {e}") from None
    return tasks


def check_sizes(cfg: Config, tasks: dict) -> None:
    """Each job's splits hold what the run draws: experiment.eval_size items of the eval split, and
    jobs.N.prompts_per_step distinct items of the train split per step. A task that knows its sizes
    (`size(split)`, e.g. gsm8k from a file) is compared with them; any other draws the run's first
    sample of each split, with the run's seeds."""
    seed = cfg.experiment.seed
    for i, j in enumerate(cfg.jobs):
        task = tasks.get(j.name)
        if task is None:  # an sft job: load_sft_data checks its conversations
            continue
        wants = (("eval", cfg.experiment.eval_size, "experiment.eval_size", derive_seed(seed, j.name, "eval")),
                 ("train", j.prompts_per_step, f"jobs.{i}.prompts_per_step", derive_seed(seed, j.name, 0, "prompts")))
        for split, n, key, sseed in wants:
            if n <= 0:
                continue
            size = getattr(task, "size", None)
            if callable(size):
                if n > size(split):
                    raise RunError(f"{key} ({n}) is larger than the {split} split of job {j.name!r} (task {j.task!r}: "
                                   f"{size(split)} items); use at most {size(split)}")
                continue
            try:
                task.sample(n, sseed, split)
            except TaskError as e:
                raise RunError(f"{key} ({n}) for job {j.name!r}: {e}") from None


def check_mps(cfg: Config, process_mps) -> None:
    """An MPS arm that requires MPS (overlap.mps_required) is refused here when this machine has no
    MPS to start (no control program or no NVIDIA device), unless the process has a daemon already
    or the run is on the CPU (which runs the arm without MPS, labelled so)."""
    if cfg.experiment.arm not in MPS_ARMS or process_mps is not None or cfg.experiment.device == "cpu":
        return
    ok, why = mps.mps_available()  # through the module: tests fake MPS by patching it
    if not ok and cfg.overlap.mps_required:
        raise RunError(f"arm {cfg.experiment.arm!r} needs MPS, which is unavailable here ({why}); set "
                       "overlap.mps_required=false to run it without MPS, labelled so")


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse a directory that holds a run (unless resuming) and one we cannot write or that is full,
    before anything is started."""
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {str(out)!r} exists and is not a directory")
    if out.exists() and not resume and any(out.iterdir()):
        raise RunError(f"--out {str(out)!r} already holds files; choose another directory or --resume it")
    probe_dir = out if out.exists() else next((p for p in out.parents if p.exists()), Path("/"))
    if not os.access(probe_dir, os.W_OK):
        raise RunError(f"--out {str(out)!r}: {str(probe_dir)!r} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".colora-probe-", dir=probe_dir)
        with os.fdopen(fd, "w") as f:
            f.write("x" * 65536)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise RunError(f"--out {str(out)!r}: cannot write there ({e.strerror or e})") from None
    free = shutil.disk_usage(probe_dir).free
    if free < 64 * 2**20:
        raise RunError(f"--out {str(out)!r}: only {free / 2**20:.0f} MiB free there; colora needs at least 64 MiB")


def check_engine(cfg: Config) -> None:
    """What vLLM refuses of the config only as it starts (colora/engine/rollout.py passes it on): a
    LoRA rank above the largest it serves, and, where the engine runs without chunked prefill (the
    CPU), a token budget per step below max_model_len, and on the CPU the LoRA kernels' second CUDA
    stream. (The scheduler's budgets against each other need no device: colora/config.py checks them.)"""
    top = VLLM_LORA_RANKS[-1]
    ranks = ", ".join(map(str, VLLM_LORA_RANKS))
    for i, j in enumerate(cfg.jobs):
        if j.lora_rank > top:
            raise RunError(f"jobs.{i}.lora_rank ({j.lora_rank}) of job {j.name!r} is above the largest LoRA rank "
                           f"vLLM serves ({top}); use at most {top}")
    if cfg.engine.max_lora_rank > top:
        raise RunError(f"engine.max_lora_rank ({cfg.engine.max_lora_rank}) is above the largest LoRA rank vLLM serves "
                       f"({top}); use 0 (the smallest that holds every job's rank) or one of {ranks}")
    g = cfg.engine
    if _cpu_run(cfg) and g.max_num_batched_tokens and g.max_num_batched_tokens < g.max_model_len:
        raise RunError(f"engine.max_num_batched_tokens ({g.max_num_batched_tokens}) must be at least "
                       f"engine.max_model_len ({g.max_model_len}) on the CPU, where vLLM runs without chunked "
                       "prefill; raise it, or set it to 0 for vLLM's default")
    if _cpu_run(cfg) and g.lora_dual_stream:
        raise RunError("engine.lora_dual_stream = true runs vLLM's LoRA kernels on a second CUDA stream; this run's "
                       "device is the CPU: set it to false")


def _cpu_run(cfg: Config) -> bool:
    """Whether the run's device is the CPU, decided without initialising CUDA (the MPS daemon must
    start first): a CPU build of torch or no NVIDIA device node means "auto" is the CPU."""
    if cfg.experiment.device != "auto":
        return cfg.experiment.device == "cpu"
    return torch.version.cuda is None or not any(Path("/dev").glob("nvidia[0-9]*"))


# The keys vLLM reads a model's longest context from, the least of those present
# (vllm/transformers_utils/model_arch_config_convertor.py, derive_max_model_len_and_key).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose factor vLLM does not apply again to the context (vllm/config/model.py)
_ROPE_PRESCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_context(model_dir: Path) -> tuple[int, str] | None:
    """The longest engine.max_model_len that vLLM accepts for the model in `model_dir` and where it
    comes from, as vLLM derives it for a decoder (config.json's context keys, a RoPE scaling factor,
    tokenizer_config.json's model_max_length); None where config.json names none."""
    hf = json.loads((model_dir / "config.json").read_text())
    hf = hf.get("text_config") or hf
    found = [(hf[k], k) for k in _CONTEXT_KEYS if isinstance(hf.get(k), (int, float))]
    if isinstance(hf.get("model_max_length"), (int, float)):  # vLLM: it overrides the others
        found = [(hf["model_max_length"], "model_max_length")]
    if not found:
        return None
    n, key = min(found)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)) \
            and (rope.get("rope_type") or rope.get("type")) not in _ROPE_PRESCALED:
        n, key = n * rope["factor"], f"{key} x rope factor {rope['factor']}"
    tok = model_dir / "tokenizer_config.json"
    if tok.is_file():
        most = json.loads(tok.read_text()).get("model_max_length")
        if isinstance(most, (int, float)) and most < n:
            n, key = most, "tokenizer_config.json's model_max_length"
    return int(n), key


def check_model_len(cfg: Config, model_dir: Path) -> None:
    """engine.max_model_len within the model's context, which vLLM refuses to exceed when it starts
    (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set)."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true"):
        return
    try:
        ctx = model_context(model_dir)
    except (OSError, ValueError) as e:
        raise RunError(f"experiment.model: {model_dir}: cannot read its context length ({e})") from None
    if ctx is not None and cfg.engine.max_model_len > ctx[0]:
        raise RunError(f"engine.max_model_len ({cfg.engine.max_model_len}) is longer than the model's context "
                       f"({ctx[0]}, {ctx[1]} of {model_dir}); use at most {ctx[0]}")


PROMPTS_CHECKED = 256  # training prompts per job whose length is checked: the first steps' (cheap, seeded)


def check_prompt_lengths(cfg: Config, model_dir: Path, tasks: dict) -> None:
    """Each job's prompts, as the engine gets them (chat template and tokenizer), plus the tokens it
    may generate, within engine.max_model_len: every held-out item with the eval budget, and the
    training items of the first steps (PROMPTS_CHECKED prompts) with max_new_tokens; `tasks` holds the
    jobs that generate. vLLM refuses a prompt that fills max_model_len at the request, mid-run, and
    cuts a response short where the two do not fit; later steps draw from the same generator but are
    not checked."""
    from colora.corun.rollouts import Prompts, step_items  # the trainer's kernels come with it: ~0.6 s of imports

    try:
        prompts = Prompts(load_tokenizer(model_dir))
    except (ModelDirError, OSError, ValueError) as e:
        raise RunError(f"experiment.model: {e}") from None
    e, limit = cfg.experiment, cfg.engine.max_model_len
    for i, j in enumerate(cfg.jobs):
        task, wants = tasks.get(j.name), []
        if task is None:  # a job that generates nothing (kind = "sft")
            continue
        steps = range(min(j.steps or e.steps, max(1, PROMPTS_CHECKED // j.prompts_per_step)))
        try:
            if e.eval_size:
                key = "experiment.eval_max_new_tokens" if e.eval_max_new_tokens else f"jobs.{i}.max_new_tokens"
                items = task.sample(e.eval_size, derive_seed(e.seed, j.name, "eval"), "eval")
                wants.append(("held-out", items, e.eval_max_new_tokens or j.max_new_tokens, key))
            items = [it for step in steps for it in step_items(task, j, e.seed, step)]
            wants.append(("training", items, j.max_new_tokens, f"jobs.{i}.max_new_tokens"))
            lengths = [max(((len(prompts.ids(it.messages)), it) for it in items), key=lambda x: x[0],
                           default=(0, None)) for _, items, _, _ in wants]
        except Exception as err:  # the task's code or the model's chat template: the job could not run
            raise RunError(f"jobs.{i}.task = {j.task!r} (job {j.name!r}): drawing its prompts and applying the "
                           f"model's chat template failed ({type(err).__name__}: {err})") from None
        for (kind, _, budget, key), (longest, item) in zip(wants, lengths):
            if longest + budget > limit:
                raise RunError(f"engine.max_model_len ({limit}) is too short for job {j.name!r}: its longest {kind} "
                               f"prompt ({item.id}) is {longest} tokens, and {key} ({budget}) more make "
                               f"{longest + budget}; raise engine.max_model_len to at least {longest + budget}, "
                               f"or lower {key}")


@dataclass
class Setup:
    """A run's checked inputs."""

    cfg: Config
    out: Path
    model_dir: Path
    tasks: dict
    adapter_sync: str = "disk"  # runtime.adapter_sync resolved: "memory" or "disk"
    data: dict = field(default_factory=dict)  # each sft job's data file as read: {job: {"file", "sha256"}}


def prepare(cfg: Config, out: Path, resume: bool = False, log: Callable[[str], None] = print,
            process_mps=None) -> Setup:
    """Every input check that needs no engine. Creates nothing on failure (a builtin model is built
    into colora's cache once the other checks that need no model pass)."""
    tasks = load_tasks(cfg.jobs)
    check_sizes(cfg, tasks)
    check_engine(cfg)
    check_out_dir(out, resume)
    check_mps(cfg, process_mps)
    sync = resolve_adapter_sync(cfg, log)
    model_dir = resolve_model(cfg.experiment.model, log)
    check_model_len(cfg, model_dir)
    check_prompt_lengths(cfg, model_dir, tasks)
    sft = load_sft_data(cfg, model_dir)
    tasks.update(sft)
    removed = remove_stale_adapter_sync()
    if removed:
        log(f"removed {len(removed)} adapter folder(s) of runs that are gone from {SHM}: "
            + ", ".join(p.name for p in removed))
    return Setup(cfg, out, model_dir, tasks, sync, {n: {"file": str(d.path), "sha256": sha256_file(d.path)}
                                                    for n, d in sft.items()})


def load_sft_data(cfg: Config, model_dir: Path) -> dict:
    """Each sft job's conversations (colora/training/sft_data.py), read, tokenized with the model's chat
    template and split; `data` relative to the config file's folder or the current directory. Every
    problem of the file is a RunError naming jobs.N.data, before the engine starts."""
    jobs = [(i, j) for i, j in enumerate(cfg.jobs) if j.kind == "sft"]
    if not jobs:
        return {}
    try:
        tok = load_tokenizer(model_dir)
    except (ModelDirError, OSError, ValueError) as e:
        raise RunError(f"experiment.model: {e}") from None
    out = {}
    for i, j in jobs:
        try:
            path = resolve_data_path(j.data, [*task_dirs(), Path.cwd()])
            out[j.name] = SftData(path, tok, job=j.name, run_seed=cfg.experiment.seed,
                                  eval_size=cfg.experiment.eval_size, max_len=cfg.engine.max_model_len)
        except SftDataError as e:
            raise RunError(f"jobs.{i}.data (job {j.name!r}): {e}") from None
    return out


def resolve_adapter_sync(cfg: Config, log: Callable[[str], None]) -> str:
    """runtime.adapter_sync resolved (colora/engine/adapters.py): "memory" where it cannot work is a
    RunError; "auto" says why it goes by disk where it does."""
    try:
        mode, why = resolve(cfg.runtime.adapter_sync)
    except AdapterSyncUnsupported as e:
        raise RunError(str(e)) from None
    if mode == "disk" and cfg.runtime.adapter_sync == "auto":
        log(f"adapters go to the engine by disk: {why}")
    return mode


# Free room /dev/shm must have for the PEFT directories of disk sync to go there: a job holds about two
# versions at once, and a rank-16 adapter of Qwen3-0.6B's shape is ~20 MiB in bf16, so 16 such jobs take
# ~640 MiB.
SCRATCH_SHM_FREE = 2**30


def adapter_scratch(out: Path, adapter_sync: str = "memory", shm: Path = SHM) -> Path:
    """The folder that the PEFT directories of adapter versions go to (colora/training/export.py's
    `disk_root`), for `adapter_sync` resolved ("memory" or "disk").

    With "memory" they hold only the versions that /dev/shm was too full to take, so they never go
    there: into the run directory, or where that is /dev/shm's filesystem too, the temporary
    directory's when it is another. With "disk" they hold every version: on /dev/shm (no disk round
    trip) where it is writable with SCRATCH_SHM_FREE free, else into the run directory."""
    if adapter_sync == "disk" and shm.is_dir() and os.access(shm, os.W_OK) \
            and shutil.disk_usage(shm).free >= SCRATCH_SHM_FREE:
        return Path(tempfile.mkdtemp(prefix="colora-adapters-", dir=shm))
    out.mkdir(parents=True, exist_ok=True)
    if _same_filesystem(out, shm) and not _same_filesystem(Path(tempfile.gettempdir()), shm):
        return Path(tempfile.mkdtemp(prefix="colora-adapters-"))
    p = out / ".adapters"
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def held_scratch(out: Path, adapter_sync: str = "memory", shm: Path = SHM) -> Iterator[Path]:
    """`adapter_scratch`'s folder for the block, held open for its life (so that another colora's start,
    which sweeps what killed runs left in /dev/shm, keeps it: `remove_stale_adapter_sync`) and removed
    when the block ends."""
    scratch = adapter_scratch(out, adapter_sync, shm)
    hold = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield scratch
    finally:
        os.close(hold)
        shutil.rmtree(scratch, ignore_errors=True)


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


STALE_AFTER_S = 60.0  # a folder this new may be a starting run's, whose first segment is not mapped yet


def remove_stale_adapter_sync(shm: Path = SHM, now: float | None = None) -> list[Path]:
    """Remove the adapter folders that runs killed before they could clean up left in `shm`: adapter-sync
    folders (`colora-adapter-sync-*`, colora/training/export.py) and disk sync's scratch
    (`colora-adapters-*`, `held_scratch`); returns those removed. A folder is a live run's while any
    process holds it open, or maps or holds open a file in it: a run holds its scratch and its trainer its
    sync folder for their life, and maps every job's segment for as long as the job runs (also once the
    engine's client has unlinked the file). Folders of other users, and those changed in the last
    STALE_AFTER_S seconds, are left alone."""
    now = time.time() if now is None else now
    candidates = []
    for d in [*shm.glob("colora-adapter-sync-*"), *shm.glob("colora-adapters-*")]:
        try:
            st = d.lstat()
        except OSError:
            continue
        if d.is_dir() and not d.is_symlink() and st.st_uid == os.getuid() and now - st.st_mtime > STALE_AFTER_S:
            candidates.append(d)
    if not candidates:
        return []
    used = _paths_in_use()
    removed = []
    for d in candidates:
        prefix = str(d) + "/"
        if not any(u == str(d) or u.startswith(prefix) for u in used):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _paths_in_use() -> set[str]:
    """The files that this user's processes map or hold open (from /proc; a deleted file's path
    without its " (deleted)")."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:  # address perms offset dev inode [path]
                    fields = line.rstrip("\n").split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        used.add(fields[5].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    used.add(os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)"))
    return used


def start_mps(cfg: Config, stack: contextlib.ExitStack, log: Callable[[str], None], process_mps, stop=None):
    """MPS for this run: the process-wide daemon if there is one, else our own for an MPS arm
    (stopped by `stack` after the engine; told to quit without waiting on a second signal of `stop`,
    a stopping.StopRequest), else none. Returns (daemon or None, note for the summary)."""
    return start_mps_for(cfg.overlap, cfg.experiment.arm, cfg.experiment.device, stack, log, process_mps, stop)


def start_mps_for(ov, arm: str, device: str, stack: contextlib.ExitStack, log: Callable[[str], None], process_mps,
                  stop=None):
    """`start_mps` from its parts: the [overlap] section's shares, the arm and experiment.device (a
    server, which has no experiment, passes overlap_mps and its device)."""
    if arm not in MPS_ARMS:
        return None, "not used by this arm"
    note = f"on: engine {ov.mps_engine_percentage}%, trainer {ov.mps_trainer_percentage}%"
    if process_mps is not None:
        note = _claim_shares(process_mps, ov, note)
        return process_mps, note + " (process-wide daemon)"
    if device == "cpu":
        return None, "UNAVAILABLE (CPU run): arm ran without MPS"
    mps = MpsDaemon()
    try:
        mps.start()
    except MpsUnavailable as e:
        if ov.mps_required:
            raise RunError(f"arm {arm!r} needs MPS, which is unavailable here ({e}); set "
                           "overlap.mps_required=false to run it without MPS, labelled so") from None
        log(f"warning: MPS unavailable ({e}): arm {arm} runs without MPS")
        return None, f"UNAVAILABLE ({e}): arm ran without MPS"
    stack.callback(lambda: log(f"MPS daemon: {mps.stop()}"))  # registered first: runs after the engine closes
    if stop is not None:
        stack.enter_context(stop.on_abort(mps.quit_nowait))
    return mps, _claim_shares(mps, ov, note)


def _claim_shares(mps, ov, note: str) -> str:
    """This process's CUDA context with the trainer's share, before the engine's client can make it
    (with whatever share the environment said then), and the engine's share for the engine process
    spawned next. The note gains the SMs the trainer's context sees."""
    try:
        sms = mps.claim(ov.mps_trainer_percentage)
    except MpsShareError as e:
        raise RunError(str(e)) from None
    mps.set_share(ov.mps_engine_percentage)
    return note + (f" (trainer sees {sms} SMs)" if sms else "")
