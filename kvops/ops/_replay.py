"""The ops' CUDA kernel in C++ (``kvops/csrc/replay.cpp``): a repeated call replays its recorded
launches without running Python.

Why: an eager call through the Python implementation spends its host time in the dispatcher's
way into Python (3.3 us on an H100 host), the output allocations through Python's argument
parser (6.7 us for ``out`` and ``lse``) and the launch glue (7.5 us), where SDPA's whole call
is 16-29 us (``bench/results/2026-12-07-1040-eager-parts-h100.md``). The C++ kernel does the
same work from a recipe: it allocates the outputs with ``at::empty_strided`` and launches the
compiled kernels with ``cuLaunchKernelEx``. On an H100 every replayed op's call cost 0.33-0.78x
SDPA's on the same tensors (``bench/results/2026-12-08-0048-eager-replay-h100.md``).

**Recipes.** A call's signature is each tensor's dispatch keys, dtype, device, sizes, strides,
requires_grad and address modulo 16, every other argument's value, and the current device,
stream and thread. A call whose signature has no recipe runs the op's Python implementation
(:func:`miss`) while this thread's launches and aten ops are noted. The record becomes a
recipe when:

- every launch went through a compiled kernel's C entry point (no JIT launch), one CTA a
  program; a tensor descriptor (the Gluon prefill's) is encoded at replay from the described
  tensor's address with the recorded shape, strides, box, element type and swizzle, the last
  eight encodings kept a descriptor;
- no aten op ran but allocations and views (a fill, a copy or a host read would not replay);
- every pointer a launch takes is an argument's (the argument's own tensor object, its
  address, or inside exactly one argument), a returned output's, or inside a kept scratch
  buffer (``kvops.kernels._workspace``, which the recipe then holds); a pointer given as no
  argument's object and equal to the address of two arguments is refused (the next call may
  pass two tensors);
- every output owns its storage, whole (no view of a larger allocation, no argument);
- no 64-bit integer parameter holds an address inside an argument, an output or kept scratch;
- and the same recipe came from the signature's previous record (outputs are fresh each call,
  so two records that agree also hide no output address in a constant).

A signature whose records give no recipe ``MAX_TRIES`` times runs Python from then on. Freeing
the kept scratch (``_workspace.clear``, or its cache starting over), or a change of backend or
validation mode, drops every recipe (:func:`refresh`); a buffer the cache replaces by a larger
one stays with the recipes that hold it.

**What runs Python.** Validation mode, backend "torch" or "triton", graph capture (the
recipes' scratch is not the graph's), direct launches off (``KVOPS_DIRECT_LAUNCH=0``), and any
signature without a recipe. Triton's launch hooks (proton) see no replayed launch: profile
with ``KVOPS_REPLAY=0`` or CUPTI.

**Building.** The kernel is compiled with the system's C++ compiler against the installed
torch (about a minute) into ``~/.cache/kvops`` (or ``$KVOPS_CACHE``): by the first ``import
kvops`` of a process with CUDA (unless ``KVOPS_REPLAY=0``), or ahead of time by ``python -m
kvops build-kernel``. Where it cannot be built or loaded, every op's CUDA kernel is its Python
implementation.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import math
import os
import struct
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvops import _config
from kvops.kernels import _launch, _workspace
from kvops.ops import _library

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "replay.cpp"
NAME = "kvops_replay"
ENABLED = os.environ.get("KVOPS_REPLAY", "1").strip().lower() not in ("0", "false", "off", "no")
MAX_TRIES = 8          # records a signature gets to give a recipe (a first call compiles, a
                       # second probes the launcher, and a descriptor launch's first direct
                       # call notes no metadata: three records that give none)
MAX_PENDING = 4096     # signatures with a record awaiting its twin

ARG, OUT, ABS, VAL, DESC = 0, 1, 2, 3, 4     # a parameter's source (replay.cpp's Kind)

# aten ops a recorded call may run: allocations (the outputs, the scratch's first call) and
# views; anything else is work the recipe would not replay
_FACTORIES = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.detach.default, torch.ops.aten.alias.default,
})
_DEVICE_TYPES = ("cuda",)   # where recipes are made (the CPU tests add "cpu", with dry launches)
_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64,
             "u1": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64}
_FLOAT_FORMATS = {"fp16": ("<e", "<H"), "fp32": ("<f", "<I"), "f32": ("<f", "<I"),
                  "fp64": ("<d", "<Q")}


class Refused(Exception):
    """A record that gives no recipe (the message says why; tests read it)."""


# ---- building and installing the C++ kernel --------------------------------------------------

def _cache_dir() -> Path:
    root = os.environ.get("KVOPS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvops")
    return Path(root)


def _cuda_header_dir() -> Path | None:
    """Triton's copy of ``cuda.h`` (the kernel needs its types only)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "include"
    return d if (d / "cuda.h").exists() else None


def library_path() -> Path:
    """Where the built kernel for this source, torch and Python lives."""
    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                         + sys.version.encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return _cache_dir() / f"replay-{tag}" / f"{NAME}{suffix}"


def build_command(out: Path) -> list[str]:
    """The compiler command that builds the kernel into ``out``."""
    from torch.utils import cpp_extension as ext

    cuda_h = _cuda_header_dir()
    if cuda_h is None:
        raise RuntimeError("building the replay kernel needs triton's cuda.h "
                           "(triton/backends/nvidia/include), which this triton lacks")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # the flags that let this module's pybind11 share types with torch's (empty on torch >= 2.13)
    with warnings.catch_warnings():     # deprecated where it returns nothing
        warnings.simplefilter("ignore", DeprecationWarning)
        pybind = getattr(ext, "_get_pybind11_abi_build_flags", list)()
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
           "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H", *pybind,
           str(SOURCE), "-o", str(out), f"-I{cuda_h}", f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-I{p}" for p in ext.include_paths()]
    cmd += [f"-L{p}" for p in ext.library_paths()]
    cmd += [f"-Wl,-rpath,{p}" for p in ext.library_paths()]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    return cmd


def build(verbose: bool = False) -> Path:
    """Compile the kernel (if this source, torch and Python have none yet); returns its path."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # one process builds; the others wait for it
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = build_command(tmp)
        if verbose:
            print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the replay kernel failed ({cmd[0]} exit "
                               f"{done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(tmp, out)   # whole or absent: a concurrent import never loads half a file
    return out


_MODULE = None


def module():
    """The built kernel's module (loaded once), or None where it is not built."""
    global _MODULE
    if _MODULE is None:
        path = library_path()
        if not path.exists():
            return None
        spec = importlib.util.spec_from_file_location(NAME, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULE = mod
    return _MODULE


def installed() -> bool:
    """Whether the C++ kernel is every op's CUDA kernel now."""
    return _STATE["installed"]


def install() -> bool:
    """Make the C++ kernel every op's CUDA kernel where it is built (returns whether it is)."""
    if _STATE["installed"]:
        return True
    if not ENABLED:
        return False
    mod = module()
    if mod is None:
        return False
    _library.cuda_python(False)
    try:
        mod.install("kvops", "CUDA", sorted(_library.IMPLS), miss)
    except BaseException:
        mod.uninstall("kvops")
        _library.cuda_python(True)       # the ops keep a CUDA kernel: Python's
        raise
    _STATE["installed"] = True
    refresh()
    return True


def refresh() -> None:
    """Drop every recipe and decide again whether calls may replay (the settings in the module
    doc); the hooks of ``_workspace`` and ``_config`` call it."""
    _PENDING.clear()
    if _MODULE is not None:
        _MODULE.clear()
        _MODULE.set_enabled(may_replay())


def may_replay() -> bool:
    return (_config.backend() == "auto" and not _config.validate()
            and _launch._STATE["direct"])


def wanted() -> bool:
    """Whether this process installs a built kernel: CUDA present, the interpreter off and
    ``KVOPS_REPLAY`` not saying no."""
    return ENABLED and not _config.interpreting() and torch.cuda.is_available()


# ---- recording -------------------------------------------------------------------------------

class _Watch(TorchDispatchMode):
    """Notes the first aten op a recorded call runs that is not an allocation or a view."""

    def __init__(self):
        super().__init__()
        self.work = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.work is None and func not in _FACTORIES and not func.is_view:
            self.work = func
        return func(*args, **(kwargs or {}))


# signature -> [tries, the last record's recipe or None]; "never": gives no recipe
_PENDING: dict = {}
REFUSED: dict = {}   # op name -> why its last refused record gave no recipe (tests, benches)


def miss(name: str, signature, args: tuple):
    """The C++ kernel's way into Python: run op ``name`` on ``args``; returns ``(result,
    recipe)``, a recipe where ``signature`` (bytes, or None: do not record) has two records
    that agree (module doc)."""
    impl = _library.IMPLS[name.partition("::")[2]]
    if signature is None:
        return impl(*args), None
    key = (name, signature)
    state = _PENDING.get(key)
    if state == "never":
        return impl(*args), None
    watch = _Watch()
    with _launch.recording() as notes, watch:
        result = impl(*args)
    try:
        if watch.work is not None:
            raise Refused(f"ran {watch.work}")
        recipe = make_recipe(args, result, notes, _workspace.kept())
    except Exception as e:  # noqa: BLE001 - the call has run: a record that fails gives no recipe
        recipe = None
        REFUSED[name] = f"{type(e).__name__}: {e}" if not isinstance(e, Refused) else str(e)
    tries, last = state if state is not None else (0, None)
    if _agree(recipe, last):
        _PENDING.pop(key, None)
        _OWNERS.update((id(n[0]), n[0]) for n in notes)
        return result, recipe
    if tries + 1 >= MAX_TRIES:
        _PENDING[key] = "never"
    else:
        if len(_PENDING) >= MAX_PENDING:
            _PENDING.clear()
        _PENDING[key] = (tries + 1, recipe)
    return result, None


def _agree(recipe, last) -> bool:
    """Whether two records gave the same recipe (the kept buffers compared by identity: ``==``
    on tensors compares their values)."""
    return (recipe is not None and last is not None and recipe[:3] == last[:3]
            and len(recipe[3]) == len(last[3])
            and all(a is b for a, b in zip(recipe[3], last[3])))


_OWNERS: dict = {}   # id -> a compiled kernel a recipe launches (it owns its function handle)


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s address to the end of its last element (0 when it has none)."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _outputs(result) -> tuple:
    if result is None:
        return ()
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(result)


def make_recipe(args: tuple, result, notes: list, kept: tuple) -> tuple:
    """The recipe of one recorded call (``replay.cpp``'s form): ``(device, outputs,
    launches, the kept buffers its launches address)``; raises :class:`Refused` where the
    record gives none (module doc).

    ``notes``: the launches the call made (``_launch.recording``); ``kept``: the kept scratch
    buffers as ``(start, end, buffer)``."""
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not tensors:
        raise Refused("no tensor argument")
    device = tensors[0][1].device
    if device.type not in _DEVICE_TYPES:
        raise Refused(f"arguments on {device}")
    outs = _outputs(result)
    arg_storages = {a.untyped_storage().data_ptr() for _, a in tensors if a.numel()}
    seen = set()
    out_specs = []
    for j, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            raise Refused(f"output {j} is not a tensor")
        st = t.untyped_storage()
        if (t.device != device or t._base is not None or t.storage_offset() != 0
                or st.nbytes() != _span(t) or (t.numel() and st.data_ptr() in arg_storages)
                or (t.numel() and st.data_ptr() in seen)):
            raise Refused(f"output {j} does not own its storage whole")
        seen.add(st.data_ptr())
        out_specs.append((tuple(t.shape), tuple(t.stride()), t.dtype))
    where = _Where(tensors, outs, kept)
    launches = []
    for n in notes:
        if n is None:
            raise Refused("a launch not through the C entry point")
        launches.append(_launch_spec(*n, where))   # (compiled, grid, params, descriptors)
    # the kept buffers the launches address: the recipe holds them, so a buffer another thread
    # replaces or frees is not reused while a replay that read its address still launches
    return (-1 if device.index is None else device.index, tuple(out_specs), tuple(launches),
            tuple(where.held.values()))


class _Where:
    """Finds the source of a pointer a launch took (``ARG``, ``OUT`` or ``ABS``)."""

    def __init__(self, tensors, outs, kept):
        self.args = [(i, a.data_ptr(), _span(a)) for i, a in tensors]
        self.objs = tensors
        self.outs = [(j, t.data_ptr(), _span(t)) for j, t in enumerate(outs)]
        self.kept = kept
        self.held: dict = {}     # start -> the kept buffer a pointer lies in

    def holds(self, value: int) -> bool:
        """Whether ``value`` is an address inside an argument, an output or kept scratch."""
        return value > 0 and (
            any(base <= value < base + max(span, 1) for _, base, span in self.args + self.outs)
            or any(start <= value < end for start, end, _ in self.kept))

    def __call__(self, ptr: int, value=None) -> tuple:
        if value is not None:    # the op's own tensor object: that argument, even where
            same = [i for i, a in self.objs if a is value]   # another has its address
            if len(same) == 1:
                return (ARG, same[0], 0)
        exact = {i for i, base, _ in self.args if base == ptr}
        if len(exact) == 1:
            return (ARG, exact.pop(), 0)
        if exact:
            raise Refused(f"a pointer is the address of arguments {sorted(exact)}")
        inside = [(i, ptr - base) for i, base, span in self.args if base < ptr < base + span]
        if len(inside) == 1:
            return (ARG, *inside[0])
        if inside:
            raise Refused(f"a pointer lies inside arguments {[i for i, _ in inside]}")
        for j, base, span in self.outs:
            if base <= ptr < base + max(span, 1):
                return (OUT, j, ptr - base)
        for start, end, buf in self.kept:
            if start <= ptr < end:
                self.held[start] = buf
                return (ABS, 0, ptr)
        raise Refused(f"a pointer outside the arguments, outputs and kept scratch: {ptr:#x}")


def _launch_spec(compiled, grid: tuple, params: tuple, metas, where: _Where) -> tuple:
    run = compiled.run
    num_warps, num_ctas, shared = compiled.packed_metadata
    if num_ctas != 1:
        raise Refused(f"{compiled.name}: clusters of {num_ctas}")
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
        raise Refused(f"{compiled.name}: launcher scratch")
    types = list(compiled.src.signature.values())
    if len(types) != len(params):
        raise Refused(f"{compiled.name}: {len(params)} parameters for {len(types)} in the signature")
    packed, descs = [], []
    for ty, value in zip(types, params):
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            if metas is None or len(descs) >= len(metas):
                raise Refused(f"{compiled.name}: a descriptor without its metadata")
            desc, expanded = _descriptor(value, metas[len(descs)], where)
            packed.append((DESC, len(descs), 0))
            packed += expanded
            descs.append(desc)
            continue
        packed_one = _param(ty, value, where)
        if packed_one is not None:
            packed.append(packed_one)
    return (compiled.function, tuple(int(g) for g in grid), 32 * num_warps, shared,
            bool(run.launch_pdl), bool(run.launch_cooperative_grid), tuple(packed), tuple(descs))


def _tma_dtype_to_host() -> dict:
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError as e:     # another triton: descriptors are not replayed
        raise Refused(f"this triton has no TMA dtype map ({e})") from None
    return TMA_DTYPE_DEVICE_TO_HOST


def _descriptor(desc, meta, where: _Where) -> tuple:
    """A tensor descriptor's entry (``replay.cpp``'s Desc) and the parameters the launcher
    passes after its tensor map (shape as i32, strides as i64), from the descriptor the JIT
    takes and its compiled metadata, as triton 3.6's ``make_tensordesc_arg`` and
    ``fill_tma_descriptor`` encode them (innermost dimension first, strides in bytes)."""
    if meta is None or meta.get("fp4_padded"):
        raise Refused("a descriptor the launcher does not encode as a TMA map")
    base = getattr(desc, "base", None)
    if not isinstance(base, torch.Tensor):
        raise Refused(f"a descriptor over {type(base).__name__}")
    shape, strides = [int(x) for x in desc.shape], [int(x) for x in desc.strides]
    block = [int(x) for x in meta["block_size"]]
    rank, size = len(block), int(meta["elem_size"])
    if len(shape) != rank or len(strides) != rank or not 1 <= rank <= 5 or strides[-1] != 1:
        raise Refused(f"a descriptor of shape {shape}, strides {strides}, block {block}")
    dims = shape[::-1]
    byte_strides = [size * strides[i] for i in range(rank - 2, -1, -1)]
    byte_strides.append(dims[-1] * (size if rank == 1 else byte_strides[-1]))
    kind, index, offset = where(base.data_ptr())
    if kind not in (ARG, OUT):
        raise Refused("a descriptor over kept scratch")
    entry = (kind, index, offset, int(_tma_dtype_to_host()[int(meta["elem_type"])]),
             int(meta["swizzle"]), 1 if desc.padding == "nan" else 0,
             tuple(dims), tuple(byte_strides), tuple(block[::-1]))
    expanded = [(VAL, 0, x & 0xFFFFFFFF) for x in shape] + [(VAL, 0, x & (2**64 - 1))
                                                            for x in strides]
    return entry, expanded


def _param(ty, value, where: _Where):
    """One parameter's ``(kind, index, value)``, or None for a constexpr (not passed)."""
    if not isinstance(ty, str):
        raise Refused(f"a tuple parameter {ty}")
    if ty == "constexpr":
        return None
    if ty.startswith("*"):
        tensor = isinstance(value, torch.Tensor)
        ptr = value.data_ptr() if tensor else value
        if not isinstance(ptr, int) or ptr == 0:
            raise Refused(f"a pointer parameter given {type(value).__name__}")
        return where(ptr, value if tensor else None)
    bits = _INT_BITS.get(ty)
    if bits is not None:
        if not isinstance(value, (int, bool)):
            raise Refused(f"an {ty} parameter given {type(value).__name__}")
        if bits == 64 and where.holds(int(value)):
            # an address in an integer would be replayed as a constant
            raise Refused(f"an {ty} parameter holds an address ({int(value):#x})")
        return (VAL, 0, int(value) & ((1 << bits) - 1))
    fmt = _FLOAT_FORMATS.get(ty)
    if fmt is not None:
        try:
            packed = struct.pack(fmt[0], float(value))
        except OverflowError:     # beyond the format's range: inf, as triton's packing gives
            packed = struct.pack(fmt[0], math.copysign(math.inf, float(value)))
        return (VAL, 0, struct.unpack(fmt[1], packed)[0])
    raise Refused(f"a parameter of type {ty}")


# "installed": the C++ kernel is the ops' CUDA kernel
_STATE = {"installed": False}
_workspace.ON_CHANGE.append(refresh)
_config.ON_CHANGE.append(refresh)


def install_at_import() -> None:
    """What ``import kvops`` runs where CUDA is present, the interpreter is off and
    ``KVOPS_REPLAY`` does not say no: build the kernel if this torch and Python have none yet
    (once, about a minute, one process at a time) and install it. Where it cannot be built or
    loaded, the ops keep their Python implementations and a line on stderr says why."""
    if not wanted():
        return
    try:
        if not library_path().exists():
            print("kvops: building the ops' C++ dispatch kernel once (about a minute; "
                  "KVOPS_REPLAY=0 skips it)", file=sys.stderr, flush=True)
            build()
        install()
    except (OSError, ImportError, RuntimeError) as e:   # no compiler, a broken build: Python
        print(f"kvops: the replay kernel is not installed ({str(e)[:300]}); ops run their "
              f"Python implementations", file=sys.stderr)
