"""One short run on a CUDA machine: does tokenq's HF backend hold up on a real GPU?

The test suite runs on CPU, so four things are only ever checked here:

a. fp16 embeddings agree with fp32 ones (cosine >= 0.999) on all-MiniLM-L6-v2
   for ~64 mixed English/Chinese texts: half precision is the CUDA default,
   and a silent precision bug would pass every CPU test;
b. a real CUDA out-of-memory error is recovered: most free memory is taken
   by a ballast tensor, then a batch of 4096 x 256-token rows (doubling until
   torch runs out of memory) goes through ``run_isolated``, which must split
   it and answer every row, each equal to the row run in a small batch;
c. ``calibrate_budget`` (what ``--max-batch-tokens auto`` uses) on this
   device, and the reason it gives;
d. throughput in tokens/s for the sample texts packed under that budget;
e. ONNX Runtime's CUDA provider against torch fp16: the model exported by
   the worker's own exporter (``worker/backends/hf/export.py``, in fp16),
   run with I/O binding on the device, over check d's batches; the vectors
   must agree (cosine >= 0.999) and a verdict line says which runtime is
   faster. This is the measurement ``--runtime onnx`` on CUDA waits for
   (docs/decisions/0040-onnx-runtime.md); skipped, not failed, without ``onnxruntime-gpu``.

It prints one line per check and a summary, and exits 1 if a check failed,
0 when all passed or were skipped, and 0 with "no CUDA device; skipped"
when there is no GPU (so CI can run it everywhere). Run it through
``scripts/gpu_check.sh`` (``GPU_CHECK_ONNX=1`` installs onnxruntime-gpu for e).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE = REPO_ROOT / "scripts" / "data" / "sample.jsonl"
GIB = 1 << 30


@dataclass
class Check:
    """One line of the summary."""

    name: str
    ok: bool
    detail: str
    skipped: bool = False
    """Not run here (a package missing); neither a pass nor a failure."""
    notes: tuple[str, ...] = ()
    """Lines printed under the check's own, each on its own line (a verdict)."""


def sample_texts(count: int) -> list[str]:
    """``count`` sample texts spread over all lengths and both languages (deterministic)."""
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line]
    rows.sort(key=lambda row: len(row["text"]))
    step = max(1, len(rows) // count)
    return [row["text"] for row in rows[::step][:count]]


def all_texts() -> list[str]:
    return [
        json.loads(line)["text"]
        for line in SAMPLE.read_text(encoding="utf-8").splitlines()
        if line
    ]


def cosines(a: Any, b: Any) -> Any:
    """Row-wise cosine similarity of two (rows x dim) arrays."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def load(model: str | None, dtype: str) -> Any:
    from tokenq.worker.backends.hf.backend import HFBackend, HFOptions

    return HFBackend.load(HFOptions(model=model, device="cuda", dtype=dtype))


def embed(backend: Any, texts: Sequence[str]) -> Any:
    """Embeddings of ``texts`` (truncated to the model's limit) in one batch."""
    import numpy as np

    from tokenq.worker.backends.base import TextInput

    encodings = backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)
    return np.stack(backend.run(encodings))


# ------------------------------------------------------------------------ checks


def check_fp16(model: str | None, texts: Sequence[str], fp16: Any) -> Check:
    """(a) fp16 against fp32 on the same texts."""
    fp32 = load(model, "fp32")
    try:
        reference = embed(fp32, texts)
    finally:
        fp32.close()
    cos = cosines(embed(fp16, texts), reference)
    worst = float(cos.min())
    return Check(
        "fp16 vs fp32",
        worst >= 0.999,
        f"{len(texts)} texts, min cosine {worst:.6f}, mean {float(cos.mean()):.6f} (need >= 0.999)",
    )


class Ballast:
    """Most of the GPU's free memory, held in 1 GiB tensors, so a batch runs out of it.

    Taking the memory away is what makes a *real* CUDA OOM reachable with a
    batch of a few thousand rows, on any size of GPU, in seconds.
    """

    def __init__(self, device: Any, headroom_bytes: int) -> None:
        import torch

        self.blocks: list[Any] = []
        torch.cuda.empty_cache()
        _free, total = torch.cuda.mem_get_info(device)
        while len(self.blocks) < total // GIB:  # a bound, should the free count not move
            free, _total = torch.cuda.mem_get_info(device)
            if free - GIB < headroom_bytes:
                break
            try:
                self.blocks.append(torch.empty(GIB, dtype=torch.uint8, device=device))
            except torch.cuda.OutOfMemoryError:
                break
        self.bytes = len(self.blocks) * GIB

    def release(self) -> None:
        import torch

        self.blocks.clear()
        torch.cuda.empty_cache()


def check_oom(
    backend: Any, texts: Sequence[str], headroom_gib: float, start_rows: int, max_rows: int
) -> Check:
    """(b) a batch that really runs out of CUDA memory, recovered by run_isolated."""
    import numpy as np
    import torch

    from tokenq.worker.backends.base import TextInput
    from tokenq.worker.pipeline.execute import FailedRun, Failure, is_out_of_memory, run_isolated

    limit = backend.info.max_input_tokens
    encodings = backend.tokenize([TextInput(t) for t in texts], limit)
    full = [e for e in encodings if e.length == limit]
    if not full:
        return Check("forced OOM", False, f"no sample text reaches {limit} tokens")
    # Each distinct row alone (a small batch), to compare the split results with.
    alone = np.stack(backend.run(full))
    ballast = Ballast(backend.device, int(headroom_gib * GIB))
    try:
        rows, batch = start_rows, None
        while rows <= max_rows:
            batch = [full[i % len(full)] for i in range(rows)]
            try:
                backend.run(batch)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                break
            rows *= 2
        else:
            return Check(
                "forced OOM",
                False,
                f"no OOM up to {max_rows} rows x {limit} tokens "
                f"with {ballast.bytes / GIB:.0f} GiB of ballast",
            )
        assert batch is not None
        runs: list[FailedRun] = []
        started = time.perf_counter()
        outcome = run_isolated(backend, batch, runs)
        seconds = time.perf_counter() - started
        ooms = [event for event in runs if event.reason == "oom"]
        errors = [event for event in runs if event.reason != "oom"]
    finally:
        ballast.release()
    failures = [o for o in outcome if isinstance(o, Failure)]
    answered = [o for o in outcome if not isinstance(o, Failure)]
    worst = 0.0
    if answered and not failures:
        expected = np.stack([alone[i % len(full)] for i in range(len(batch))])
        worst = float(cosines(np.stack(answered), expected).min())
    splits = sum(event.rows > 1 for event in ooms + errors)
    smallest_oom = min((event.rows for event in ooms), default=0)
    ok = bool(ooms) and not failures and len(answered) == len(batch) and worst >= 0.999
    torch.cuda.empty_cache()
    return Check(
        "forced OOM",
        ok,
        f"{rows} rows x {limit} tokens ran out of memory ({ballast.bytes / GIB:.0f} GiB ballast, "
        f"~{headroom_gib:g} GiB left); run_isolated: {len(ooms)} OOMs (smallest "
        f"{smallest_oom} rows), {len(errors)} other errors, {splits} splits, "
        f"{len(answered)}/{len(batch)} rows answered, {len(failures)} failed, "
        f"min cosine to the rows run alone {worst:.6f}, {seconds:.1f}s",
    )


def check_calibrate(backend: Any, max_rows: int) -> tuple[Check, int]:
    """(c) the auto budget, as a worker with ``--max-batch-size max_rows`` would get it."""
    from tokenq.worker.backends.calibrate import calibrate_budget

    started = time.perf_counter()
    tokens, reason = calibrate_budget(backend, max_rows=max_rows)
    seconds = time.perf_counter() - started
    ok = tokens >= backend.info.max_input_tokens
    return Check(
        f"calibrate_budget (max_rows {max_rows})",
        ok,
        f"{tokens} tokens in {seconds:.1f}s; reason: {reason}",
    ), tokens


def packed_batches(backend: Any, budget: int, max_rows: int, repeat: int) -> list[Any]:
    """The sample texts, ``repeat`` times, packed by tokenq's packer under ``budget``."""
    from tokenq.shared.packer import Budget, CostModel, Packer
    from tokenq.worker.backends.base import TextInput

    texts = all_texts() * repeat
    encodings = backend.tokenize([TextInput(t) for t in texts], backend.info.max_input_tokens)
    packer: Packer[Any] = Packer(Budget(budget, max_rows, CostModel.PADDED))
    for encoding in encodings:
        packer.add(encoding.length, 0.0, encoding)
    batches = []
    while packer:
        batch = packer.next_batch(0.0, flush=True)
        assert batch is not None
        batches.append(batch)
    return batches


def check_throughput(backend: Any, budget: int, max_rows: int, repeat: int) -> Check:
    """(d) tokens/s over the sample texts, packed by tokenq's packer under ``budget``."""
    import torch

    if budget < backend.info.max_input_tokens:
        return Check("throughput", False, f"budget {budget} is below the max input length")
    batches = packed_batches(backend, budget, max_rows, repeat)
    rows = sum(b.rows for b in batches)
    backend.run(batches[0].payloads)  # warm-up: kernels, allocator
    torch.cuda.synchronize(backend.device)
    started = time.perf_counter()
    for batch in batches:
        backend.run(batch.payloads)  # returns numpy rows, so each batch is complete
    seconds = time.perf_counter() - started
    real = sum(b.tokens for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    return Check(
        "throughput",
        real > 0,
        f"{real / seconds:,.0f} tokens/s ({padded / seconds:,.0f} padded tokens/s), "
        f"{rows} texts, {len(batches)} batches of ~{rows / len(batches):.0f} rows "
        f"under budget {budget}, padding efficiency {real / padded:.3f}, {seconds:.2f}s",
    )


# ---------------------------------------------- (e) ONNX Runtime's CUDA provider

MISSING_PROVIDER = "skipped: onnxruntime-gpu not installed (pip install onnxruntime-gpu)"
MIN_COSINE = 0.999
Padded = tuple[Any, Any, Any]
"""One batch as the transformer takes it: ids, attention mask, type ids (CPU tensors)."""


def onnx_cuda_missing() -> str | None:
    """Why check e cannot run in this Python, or None when it can.

    ``onnxruntime`` (CPU) and ``onnxruntime-gpu`` install the same module;
    only the second lists the CUDA provider. ``onnx`` is what torch's
    exporter and ONNX Runtime's fusion pass import.
    """
    try:
        import onnxruntime
    except ImportError:
        return MISSING_PROVIDER
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return MISSING_PROVIDER
    try:
        import onnx  # noqa: F401
    except ImportError:
        return "skipped: onnx not installed (pip install onnx)"
    return None


def verdict(ratio: float, min_cosine: float) -> str:
    """The line the decision on ``--runtime onnx`` for CUDA is made from."""
    line = f"onnx-cuda faster than torch fp16: {'yes' if ratio > 1.0 else 'no'} ({ratio:.2f}x)"
    if min_cosine < MIN_COSINE:
        line += f", but the vectors disagree (min cosine {min_cosine:.6f} < {MIN_COSINE})"
    return line


def pad(encodings: Sequence[Any], pad_id: int) -> Padded:
    """A batch padded to its longest row, as ``HFBackend.run`` pads it (right, with a mask)."""
    import torch

    longest = max(e.length for e in encodings)
    ids = torch.full((len(encodings), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encodings), longest), dtype=torch.long)
    type_ids = torch.zeros((len(encodings), longest), dtype=torch.long)
    for row, encoding in enumerate(encodings):
        ids[row, : encoding.length] = torch.tensor(encoding.ids)
        mask[row, : encoding.length] = 1
        if encoding.type_ids is not None:
            type_ids[row, : encoding.length] = torch.tensor(encoding.type_ids)
    return ids, mask, type_ids


def mean_pooled(hidden: Any, mask: Any) -> Any:
    """Mean over the real tokens, L2-normalised, in fp32: all-MiniLM-L6-v2's head.

    Applied alike to both runtimes' hidden states, so the comparison sees
    only the transformer's arithmetic.
    """
    import torch

    weights = mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * weights).sum(dim=1)
    mean = summed / weights.sum(dim=1).clamp(min=1.0)
    return torch.nn.functional.normalize(mean, dim=-1)


_ORT_OUTPUT_TYPES = {"tensor(float16)": "float16", "tensor(float)": "float32"}


class BoundOnnxEncoder:
    """An ONNX Runtime session run through I/O binding on torch tensors' own memory.

    Why binding: on CUDA, ``session.run`` with numpy inputs copies them to
    the device and the hidden states back to the host, the largest tensor of
    the batch; bound, ONNX Runtime reads the ids where torch put them and
    writes the hidden states into a torch tensor on the device, which torch
    then pools there, as the torch runtime does. On the CPU (the test) the
    same code binds host memory.
    """

    def __init__(self, session: Any, device: Any, width: int) -> None:
        import numpy as np
        import torch

        output = session.get_outputs()[0]
        if output.type not in _ORT_OUTPUT_TYPES:
            raise ValueError(f"the export's output is {output.type}, not fp16 or fp32")
        name = _ORT_OUTPUT_TYPES[output.type]
        self.session = session
        self.device = device
        self.width = width
        self.dtype = getattr(torch, name)
        self._element = getattr(np, name)
        self._inputs = tuple(item.name for item in session.get_inputs())
        self._output = output.name
        self._place = ("cuda" if device.type == "cuda" else "cpu", device.index or 0)

    def __call__(self, ids: Any, mask: Any, type_ids: Any) -> Any:
        import numpy as np
        import torch

        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
        binding = self.session.io_binding()
        bound = [given[name].contiguous() for name in self._inputs]  # alive until run ends
        for name, tensor in zip(self._inputs, bound, strict=True):
            binding.bind_input(
                name, *self._place, np.int64, tuple(tensor.shape), tensor.data_ptr()
            )
        rows, tokens = ids.shape
        hidden = torch.empty((rows, tokens, self.width), dtype=self.dtype, device=self.device)
        binding.bind_output(
            self._output, *self._place, self._element, tuple(hidden.shape), hidden.data_ptr()
        )
        if self.device.type == "cuda":
            # ONNX Runtime computes on a stream of its own: torch's writes of the
            # inputs must be done first. It synchronises its stream before
            # run_with_iobinding returns, so the output is complete after it.
            torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return hidden


def open_onnx_session(ort: Any, path: Path, device: Any) -> Any:
    """A session on ``device``'s provider, with every graph optimisation, as the worker's.

    A CUDA provider that fails to load (its CUDA or cuDNN libraries missing)
    makes ONNX Runtime fall back to the CPU with only a log line; that is
    refused here, or the race would time the CPU.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if device.type == "cuda":
        providers: list[Any] = [
            ("CUDAExecutionProvider", {"device_id": device.index or 0}),
            "CPUExecutionProvider",
        ]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers)
    wanted = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
    if session.get_providers()[0] != wanted:
        raise RuntimeError(
            f"ONNX Runtime did not load {wanted} (it has {session.get_providers()}): "
            "are the CUDA and cuDNN libraries onnxruntime-gpu wants installed?"
        )
    return session


def load_torch_model(model: str | None, dtype: str) -> tuple[Any, Any, Path]:
    """Tokenizer, model (on the CPU) and model folder, loaded as ``HFBackend.load`` loads them."""
    import torch

    from tokenq.worker.backends.hf.layout import read_sentence_transformer_config
    from tokenq.worker.backends.hf.load import find_file, join, load_pretrained, resolve_model
    from tokenq.worker.backends.hf.settings import HFOptions

    torch_dtype = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    source = resolve_model(model)
    st = read_sentence_transformer_config(source, "embed")
    # Not resolve_dtype: it refuses fp16 on the CPU, where this model is only
    # exported (traced once) before it runs on CUDA.
    tokenizer, loaded = load_pretrained(
        source, st.subfolder, HFOptions(model=model, task="embed"), torch_dtype
    )
    config_path = find_file(source, join(st.subfolder, "config.json"))
    assert config_path is not None  # transformers loaded the model from it
    return tokenizer, loaded.eval(), Path(config_path).parent


def export_onnx(
    model: Any, model_dir: Path, *, uses_type_ids: bool, cache_dir: str | None
) -> Path:
    """The worker's exporter, under the key ``onnx_runtime.load_onnx_encoder`` gives it.

    The same key, so a worker started later on the same model and dtype
    reuses this export. ``model`` must be on the CPU: the exporter traces it
    with an example batch it makes there; the graph it writes does not
    depend on the device it was traced on.
    """
    from tokenq.worker.backends.hf.export import INPUTS, cache_key, default_cache_dir, export

    inputs = INPUTS if uses_type_ids else INPUTS[:2]
    key = cache_key(
        model_dir,
        {
            "task": "embed",
            "inputs": inputs,
            "class": type(model).__name__,
            "dtype": str(next(model.parameters()).dtype),
            "trust_remote_code": False,
        },
    )
    return export(model, default_cache_dir(cache_dir) / key, inputs, logits=False)


@dataclass
class RuntimeRace:
    """Both runtimes over the same batches: speed, and how far apart their vectors are."""

    tokens: int
    torch_seconds: float
    onnx_seconds: float
    min_cosine: float
    mean_cosine: float

    @property
    def torch_tps(self) -> float:
        return self.tokens / self.torch_seconds

    @property
    def onnx_tps(self) -> float:
        return self.tokens / self.onnx_seconds

    @property
    def ratio(self) -> float:
        """ONNX Runtime's tokens/s over torch's: above 1, ONNX Runtime is faster."""
        return self.onnx_tps / self.torch_tps


def embed_all(encoder: Any, batches: Sequence[Padded], device: Any) -> tuple[float, Any]:
    """Seconds to embed every batch, and the vectors.

    Each batch does what ``HFBackend.run`` does around the transformer:
    inputs to the device, the transformer, pooling there, rows back to the
    host (which also waits for the device).
    """
    import numpy as np
    import torch

    vectors = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, mask, type_ids = (tensor.to(device) for tensor in batch)
            hidden = encoder(ids, mask, type_ids)
            vectors.append(mean_pooled(hidden, mask).cpu().numpy())
    return time.perf_counter() - started, np.concatenate(vectors)


def race_runtimes(
    torch_encoder: Any, onnx_encoder: Any, batches: Sequence[Padded], device: Any, rounds: int
) -> RuntimeRace:
    """One untimed pass of each (warm-up, and the vectors compared), then ``rounds`` timed
    passes, alternating which runtime goes first; the median pass of each counts."""
    import statistics

    _seconds, reference = embed_all(torch_encoder, batches, device)
    _seconds, got = embed_all(onnx_encoder, batches, device)
    cos = cosines(got, reference)
    timed: dict[str, list[float]] = {"torch": [], "onnx": []}
    encoders = {"torch": torch_encoder, "onnx": onnx_encoder}
    for round_ in range(rounds):
        for name in ("torch", "onnx") if round_ % 2 == 0 else ("onnx", "torch"):
            timed[name].append(embed_all(encoders[name], batches, device)[0])
    return RuntimeRace(
        tokens=int(sum(int(mask.sum()) for _ids, mask, _types in batches)),
        torch_seconds=statistics.median(timed["torch"]),
        onnx_seconds=statistics.median(timed["onnx"]),
        min_cosine=float(cos.min()),
        mean_cosine=float(cos.mean()),
    )


def onnx_encoder_for(
    model: str | None, fp16_model: Any, model_dir: Path, uses_type_ids: bool,
    device: Any, cache_dir: str | None,
) -> tuple[BoundOnnxEncoder, str]:
    """The CUDA session on an fp16 export, else on an fp32 one; and which it is, and why.

    fp16 is the comparison that means something (torch runs fp16 on CUDA);
    fp32 is the fallback should the exporter or the provider not take the
    half-precision graph, said in the result.
    """
    import onnxruntime

    width = int(fp16_model.config.hidden_size)

    def encoder_on(exported: Any) -> tuple[BoundOnnxEncoder, Path]:
        path = export_onnx(exported, model_dir, uses_type_ids=uses_type_ids, cache_dir=cache_dir)
        return BoundOnnxEncoder(open_onnx_session(onnxruntime, path, device), device, width), path

    try:
        encoder, path = encoder_on(fp16_model)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    else:
        return encoder, f"fp16 export {path}"
    encoder, path = encoder_on(load_torch_model(model, "fp32")[1])
    return encoder, f"fp32 export {path} (NOT fp16: the fp16 export failed, {reason})"


def check_onnx_cuda(
    backend: Any, model: str | None, budget: int, max_rows: int, repeat: int, rounds: int,
    cache_dir: str | None,
) -> Check:
    """(e) ONNX Runtime's CUDA provider against torch fp16 on check d's batches."""
    name = "onnx-cuda vs torch fp16"
    missing = onnx_cuda_missing()
    if missing:
        return Check(name, True, missing, skipped=True)
    if budget < backend.info.max_input_tokens:
        return Check(name, False, f"budget {budget} is below the max input length")
    from tokenq.worker.backends.hf.load import pad_token_id
    from tokenq.worker.backends.hf.runtime import TorchEncoder

    tokenizer, fp16_model, model_dir = load_torch_model(model, "fp16")
    uses_type_ids = "token_type_ids" in tokenizer.model_input_names
    onnx_encoder, export_note = onnx_encoder_for(
        model, fp16_model, model_dir, uses_type_ids, backend.device, cache_dir
    )
    torch_encoder = TorchEncoder(
        fp16_model.to(backend.device), uses_type_ids=uses_type_ids, logits=False
    )
    batches = [pad(b.payloads, pad_token_id(tokenizer)) for b in
               packed_batches(backend, budget, max_rows, repeat)]
    race = race_runtimes(torch_encoder, onnx_encoder, batches, backend.device, rounds)
    return Check(
        name,
        race.min_cosine >= MIN_COSINE,
        f"torch fp16 {race.torch_tps:,.0f} tokens/s, onnx-cuda {race.onnx_tps:,.0f} tokens/s "
        f"(ratio {race.ratio:.2f}, median of {rounds} passes over {len(batches)} batches, "
        f"{race.tokens:,} tokens, I/O bound on the device); min cosine "
        f"{race.min_cosine:.6f}, mean {race.mean_cosine:.6f} (need >= {MIN_COSINE}); "
        f"{export_note}",
        notes=(verdict(race.ratio, race.min_cosine),),
    )


# -------------------------------------------------------------------------- main


def run_check(checks: list[Check], name: str, step: Callable[[], Check]) -> Check | None:
    """Run one check; an exception fails that check, not the whole run."""
    started = time.perf_counter()
    try:
        check = step()
    except Exception as exc:
        check = Check(name, False, f"raised {type(exc).__name__}: {exc}")
    checks.append(check)
    status = "SKIP" if check.skipped else "PASS" if check.ok else "FAIL"
    print(f"[{status}] {check.name}: {check.detail} ({time.perf_counter() - started:.1f}s)",
          flush=True)
    for note in check.notes:
        print(f"gpu_check: {note}", flush=True)
    return check


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or id (default: MiniLM)")
    parser.add_argument("--texts", type=int, default=64, help="texts for the fp16 check")
    parser.add_argument("--headroom-gib", type=float, default=4.0,
                        help="GPU memory left free by the ballast in the OOM check")
    parser.add_argument("--oom-rows", type=int, default=4096,
                        help="rows of max-length inputs in the first batch the OOM check tries")
    parser.add_argument("--max-oom-rows", type=int, default=1 << 20,
                        help="give up forcing an OOM past this many rows")
    parser.add_argument("--max-rows", type=int, default=256,
                        help="max_batch_size for calibration and throughput (worker default)")
    parser.add_argument("--repeat", type=int, default=10,
                        help="times the sample is repeated for the throughput check")
    parser.add_argument("--onnx-rounds", type=int, default=3,
                        help="timed passes of each runtime in the ONNX check (median counts)")
    parser.add_argument("--onnx-cache-dir", default=None,
                        help="where the ONNX export is cached (default: the worker's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed in this Python; install tokenq[worker]")
        return 1
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device; skipped (torch {torch.__version__})")
        return 0
    device = torch.cuda.get_device_properties(0)
    print(f"gpu_check: {device.name}, {device.total_memory / GIB:.0f} GiB, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    started = time.perf_counter()
    fp16 = load(args.model, "fp16")
    print(f"gpu_check: model {fp16.info.model}, max input {fp16.info.max_input_tokens}, "
          f"dim {fp16.info.dim}", flush=True)
    texts = sample_texts(args.texts)
    checks: list[Check] = []
    budget = 0

    def calibrate() -> Check:
        nonlocal budget
        check, budget = check_calibrate(fp16, args.max_rows)
        return check

    run_check(checks, "fp16 vs fp32", lambda: check_fp16(args.model, texts, fp16))
    run_check(checks, "forced OOM",
              lambda: check_oom(
                  fp16, all_texts(), args.headroom_gib, args.oom_rows, args.max_oom_rows))
    run_check(checks, "calibrate_budget", calibrate)
    run_check(checks, "calibrate_budget (more rows)",
              lambda: check_calibrate(fp16, max(args.max_rows, 4096))[0])
    run_check(checks, "throughput",
              lambda: check_throughput(fp16, budget, args.max_rows, args.repeat))
    run_check(checks, "onnx-cuda vs torch fp16",
              lambda: check_onnx_cuda(fp16, args.model, budget, args.max_rows, args.repeat,
                                      args.onnx_rounds, args.onnx_cache_dir))
    failed = [check.name for check in checks if not check.ok]
    skipped = sum(check.skipped for check in checks)
    ran = len(checks) - skipped
    print(f"gpu_check: {ran - len(failed)}/{ran} passed"
          + (f", {skipped} skipped" if skipped else "")
          + f" in {time.perf_counter() - started:.0f}s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
