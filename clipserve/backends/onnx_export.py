"""Exporting the image tower to ONNX, and the cache that keeps exports across restarts.

Two graphs per export, chained on the executor's device without a host round trip:
  normalize-<dtype>.onnx  uint8 NHWC → normalised NCHW (Cast, Transpose, Mul, Add, Cast)
  image-<dtype>.onnx      normalised NCHW → embeddings (the open_clip visual tower)
Clients that send already-normalised float tensors skip the first graph. Keeping the prefix
separate keeps the big graph the plain model (one TensorRT engine, the same graph `export`
writes for other runtimes) rather than two copies of the weights for two input kinds.

An export is written into a staging folder and complete only once its marker (`meta_path`,
written last) is in place and every file it lists has the listed size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import io
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from clipserve.backends.base import normalisation_affine
from clipserve.errors import StartupError
from clipserve.inference.model import LoadedModel
from clipserve.inference.preprocess import PreprocessSpec

if TYPE_CHECKING:
    from onnx import ModelProto

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bump when the export code changes what it writes: the cache key holds it.
EXPORT_FORMAT = 1
OPSET = 18
IR_VERSION = 10  # the IR of opsets up to 21
INPUT = "pixel_values"
OUTPUT = "image_embeds"
PIXELS = "pixels"
FP32_MIN_COSINE = 0.99999
FP16_MIN_COSINE = 0.999


@dataclass(frozen=True)
class ExportedModel:
    directory: Path
    image: Path
    normalize: Path
    precision: str
    reused: bool = False  # found complete in the cache, not written by this process


@contextlib.contextmanager
def onnxruntime_warnings_logged() -> Iterator[None]:
    """onnxruntime reports its environment (a distro it was not tested on, a bundled CUDA plugin
    that cannot load, missing CUDA libraries) as Python warnings at import and in preload_dlls:
    diagnostics for the server log. What they lead to (a provider that cannot run) is checked
    and refused with one clear StartupError by the executor."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        log.warning("onnxruntime: %s", warning.message)


def import_onnxruntime() -> ModuleType:
    """onnxruntime, its import-time warnings logged. It has no type information: what is read
    from the module is untyped."""
    with onnxruntime_warnings_logged():
        return importlib.import_module("onnxruntime")


def library_versions() -> dict[str, str]:
    import onnx
    import torch

    from clipserve import __version__

    return {
        "clipserve": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": import_onnxruntime().__version__,
        "opset": str(OPSET),
    }


def cache_key(model: LoadedModel, digest: str) -> str:
    """`digest` covers the weights; the rest is what changes the graphs without them: the
    libraries, the export code, the architecture (quick_gelu, say) and the preprocessing
    baked into normalize-*.onnx."""
    graph = {
        "versions": library_versions(),
        "format": EXPORT_FORMAT,
        "architecture": hashlib.sha256(repr(model.module.visual).encode()).hexdigest(),
        "preprocess": dataclasses.asdict(model.preprocess),
    }
    h = hashlib.sha256(json.dumps(graph, sort_keys=True).encode()).hexdigest()
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)
    return f"{safe_name}-{digest}-{h[:12]}"


def normalize_graph(spec: PreprocessSpec, dtype: str) -> ModelProto:
    """uint8 (N, H, W, 3) → float (N, 3, H, W) in `dtype`, normalised with the model's mean/std."""
    from onnx import TensorProto, helper, numpy_helper

    scale, bias = normalisation_affine(spec)
    h, w = spec.size
    out_type = TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", [PIXELS], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["as_float"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", ["nchw", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias"], ["normalised"]),
        helper.make_node("Cast", ["normalised"], [INPUT], to=out_type),
    ]
    graph = helper.make_graph(
        nodes,
        "clipserve_normalize",
        [helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, ["batch", h, w, 3])],
        [helper.make_tensor_value_info(INPUT, out_type, ["batch", 3, h, w])],
        initializer=[
            numpy_helper.from_array(scale.reshape(1, 3, 1, 1), "scale"),
            numpy_helper.from_array(bias.reshape(1, 3, 1, 1), "bias"),
        ],
    )
    # IR version pinned: onnx writes its newest by default, which ONNX Runtime may not read yet.
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def export_image_tower(model: LoadedModel, path: Path, precision: str) -> None:
    """Write the visual tower with a dynamic batch axis, then check it with the ONNX checker."""
    import copy

    import onnx
    import torch

    visual = copy.deepcopy(model.module.visual).eval()
    dtype = torch.float16 if precision == "fp16" else torch.float32
    visual = visual.to(dtype)
    h, w = model.preprocess.size
    dummy = torch.zeros(2, 3, h, w, dtype=dtype)
    # Grad stays enabled: without it nn.MultiheadAttention takes its fused fast path
    # (aten::_native_multi_head_attention), which has no ONNX export.
    batch = torch.export.Dim("batch", min=1, max=4096)
    chatter = io.StringIO()  # the exporter prints its progress to stdout
    with torch.inference_mode(False), torch.enable_grad(), contextlib.redirect_stdout(chatter):
        program = torch.onnx.export(
            visual,
            (dummy,),
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes=({0: batch},),
            opset_version=OPSET,
            dynamo=True,
            optimize=True,
            verify=False,
            report=False,
        )
    log.debug("torch.onnx: %s", chatter.getvalue())
    assert program is not None
    program.save(str(path))
    onnx.checker.check_model(str(path), full_check=True)


def session_options(precision: str, threads: int = 0) -> Any:
    """ORT_ENABLE_ALL adds the CPU EP's layout transforms, which crash (SIGSEGV, onnxruntime
    1.31) on FP16 graphs: FP16 sessions stop at ORT_ENABLE_EXTENDED."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    levels = ort.GraphOptimizationLevel
    options.graph_optimization_level = (
        levels.ORT_ENABLE_EXTENDED if precision == "fp16" else levels.ORT_ENABLE_ALL
    )
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def compare_with_torch(model: LoadedModel, exported: ExportedModel, batch: int = 4) -> float:
    """Min cosine between ONNX Runtime (CPU) and PyTorch FP32 over one random uint8 batch."""
    import torch

    from clipserve.backends.base import normalise_numpy

    ort = import_onnxruntime()

    rng = np.random.default_rng(0)
    h, w = model.preprocess.size
    pixels = rng.integers(0, 256, (batch, h, w, 3), dtype=np.uint8)
    with torch.inference_mode():
        want = model.module.visual(torch.from_numpy(normalise_numpy(pixels, model.preprocess)))
    options = session_options(exported.precision)
    providers = ["CPUExecutionProvider"]
    norm = ort.InferenceSession(str(exported.normalize), options, providers=providers)
    image = ort.InferenceSession(str(exported.image), options, providers=providers)
    x = norm.run(None, {PIXELS: pixels})[0]
    got = image.run(None, {INPUT: x})[0].astype(np.float32)
    a, b = got, want.numpy()
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def meta_path(directory: Path, precision: str) -> Path:
    """The marker of a complete export, one per precision: written last, it lists each file of
    the export (external weights included) with its size."""
    return directory / f"meta-{precision}.json"


def is_complete(directory: Path, precision: str) -> bool:
    try:
        files = json.loads(meta_path(directory, precision).read_text())["files"]
        return bool(files) and all((directory / n).stat().st_size == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def staging_dir(target: Path, what: str) -> Path:
    """A new folder beside `target` to write into before moving it there, named by process and
    thread so no two writers share one. An unwritable cache is a StartupError, not an OSError."""
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_native_id()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as e:
        raise unwritable(target.parent, what, e) from None
    return staging


def unwritable(folder: Path, what: str, error: OSError) -> StartupError:
    return StartupError(
        f"cannot write the {what} cache in {folder} ({error.strerror or error}); "
        "pass --cache-dir a writable folder"
    )


def sweep_staging(parent: Path, pattern: str = "*.tmp-*", older_than_s: float = 3600) -> None:
    """Remove staging folders that a killed process left (each can hold a whole model)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for stale in parent.glob(pattern):
            with contextlib.suppress(OSError):
                if stale.is_dir() and now - stale.stat().st_mtime >= older_than_s:
                    log.info("removing a stale staging folder %s", stale)
                    shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def folder_lock(target: Path, what: str) -> Iterator[None]:
    """An exclusive flock on `<target>.lock`: processes sharing a cache volume (replicas) write
    `target` one at a time. Released with the file, also when the process is killed."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = target.with_name(f"{target.name}.lock").open("a")
    except OSError as e:
        raise unwritable(target.parent, what, e) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(target: Path, what: str, build: Callable[[Path], T]) -> T:
    """`build(folder)` on `target` where it exists (it only ever exists complete), else on a
    staging folder renamed to `target` once `build` returns, under `folder_lock`."""
    if target.is_dir():
        return build(target)
    with folder_lock(target, what):
        if target.is_dir():  # another process built it while this one waited
            return build(target)
        # Builders hold the lock: a staging folder seen here is a killed build's.
        sweep_staging(target.parent, f"{target.name}.tmp-*", older_than_s=0)
        staging = staging_dir(target, what)
        try:
            result = build(staging)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return result


def install(staging: Path, directory: Path, precision: str) -> None:
    """Move a finished export into place: one rename where `directory` is new, else file by file
    (the other precision or TensorRT engines live there), the marker dropped first and moved
    last, so a kill in between leaves an export that is not trusted."""
    try:
        staging.rename(directory)
        return
    except OSError:
        pass
    marker = meta_path(directory, precision)
    marker.unlink(missing_ok=True)
    for f in sorted(staging.iterdir(), key=lambda f: f.name == marker.name):
        f.replace(directory / f.name)
    staging.rmdir()


def export(model: LoadedModel, directory: Path, precision: str) -> ExportedModel:
    """Export both graphs into `directory`, complete once its marker is there (`meta_path`)."""
    staging = staging_dir(directory, "ONNX export")
    try:
        return _export(model, staging, directory, precision)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _export(model: LoadedModel, staging: Path, directory: Path, precision: str) -> ExportedModel:
    import onnx

    t0 = time.perf_counter()
    image = staging / f"image-{precision}.onnx"
    normalize = staging / f"normalize-{precision}.onnx"
    try:
        export_image_tower(model, image, precision)
        onnx.save(normalize_graph(model.preprocess, precision), str(normalize))
        onnx.checker.check_model(str(normalize), full_check=True)
        cosine = compare_with_torch(model, ExportedModel(staging, image, normalize, precision))
    except StartupError:
        raise
    except Exception as e:
        raise StartupError(f"ONNX export of {model.name} failed ({type(e).__name__}: {e})") from e
    floor = FP16_MIN_COSINE if precision == "fp16" else FP32_MIN_COSINE
    if cosine < floor:
        raise StartupError(f"exported ONNX model disagrees with PyTorch (min cosine {cosine:.6f})")
    meta = {
        "model": model.identity,
        "precision": precision,
        "min_cosine_vs_torch": cosine,
        "versions": library_versions(),
        "format": EXPORT_FORMAT,
        "input": INPUT,
        "output": OUTPUT,
        "files": {f.name: f.stat().st_size for f in staging.iterdir()},
    }
    meta_path(staging, precision).write_text(json.dumps(meta, indent=2))
    try:
        install(staging, directory, precision)
    except OSError as e:
        raise StartupError(f"cannot move the ONNX export into {directory} ({e})") from e
    what, took = f"{model.identity} ({precision})", time.perf_counter() - t0
    log.info(
        "exported %s to %s in %.1f s; min cosine vs PyTorch %.7f", what, directory, took, cosine
    )
    return ExportedModel(directory, directory / image.name, directory / normalize.name, precision)


def cached_export(model: LoadedModel, cache_dir: Path, precision: str) -> ExportedModel:
    """The export for this graph, these weights, library versions and precision: reused if
    complete (`is_complete`), else written."""
    directory = cache_dir / "onnx" / cache_key(model, model.visual_digest)
    sweep_staging(directory.parent)
    if is_complete(directory, precision):
        return _reused(directory, precision)
    # Replicas sharing a cache volume export one at a time: the others wait, then reuse it
    # (two installing file by file into one folder would replace files the other is opening).
    with folder_lock(directory, "ONNX export"):
        if is_complete(directory, precision):
            return _reused(directory, precision)
        return export(model, directory, precision)


def _reused(directory: Path, precision: str) -> ExportedModel:
    image = directory / f"image-{precision}.onnx"
    log.info("reusing ONNX export %s", image)
    normalize = directory / f"normalize-{precision}.onnx"
    return ExportedModel(directory, image, normalize, precision, reused=True)


def damage(exported: ExportedModel) -> str | None:
    """What the ONNX checker finds wrong with an export's graphs, None if nothing."""
    import onnx

    for path in (exported.normalize, exported.image):
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except Exception as e:
            return f"{path.name}: {type(e).__name__}: {e}"
    return None


def open_cached_export(
    model: LoadedModel, cache_dir: Path, precision: str, open_: Callable[[ExportedModel], T]
) -> T:
    """`open_(export)` on the cached export. One that ONNX Runtime cannot load and the checker
    finds damaged (damage of the same size, which the marker cannot see) loses its marker and is
    exported once more; any other error is open_'s own (not worth a new export)."""
    exported = cached_export(model, cache_dir, precision)
    try:
        return open_(exported)
    except StartupError:
        raise
    except Exception:
        found = damage(exported) if exported.reused else None
        if found is None:
            raise
    log.warning("cached ONNX export %s is damaged (%s); exporting it again", exported.image, found)
    meta_path(exported.directory, precision).unlink(missing_ok=True)
    exported = cached_export(model, cache_dir, precision)
    try:
        return open_(exported)
    except StartupError:
        raise
    except Exception as e:
        raise StartupError(
            f"ONNX Runtime cannot load {exported.image} ({type(e).__name__}: {e})"
        ) from e
