"""The Triton farthest point sampling kernel (attention/fps_triton.py) against the torch loop, index for index.

The kernel runs on CPU tensors under Triton's interpreter, which ``TRITON_INTERPRET=1`` turns on when the kernel
is defined (at import), so it runs in a subprocess: the setting then reaches no other test of this worker. The
interpreter rounds each float32/float64 operation as the GPU does with ``enable_fp_fusion=False``, except
``tl.fma``, which it computes as ``x * y + z`` in NumPy, rounding twice: the subprocess gives it a once-rounded
fma (:func:`attention.pointops.fma32`, itself tested against exact rationals in tests/attention/test_pointops.py)
so that ``like_kernel``'s fused distances are the GPU's. :func:`test_kernel_compiles_for_sm90_as_the_gpu_runs_it`
checks, without a GPU, the code compiled for one: no fused multiply-add in the plain kernel, pointnet2_ops' nesting
in the fused one. The tests marked ``cuda`` run the kernel on a GPU. Triton is in the lock: if it does not import,
these tests fail. They pass under Triton 3.6 as under 3.8 (the kernel's loops are ``while`` loops for 3.6's
interpreter).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attention import pointops, triton_kernels
from attention.pointops import farthest_point_sample

ROOT = Path(__file__).resolve().parents[2]

# Runs in the subprocess: reads the cases, runs the kernel under the interpreter, writes what it returned.
INTERPRET = """
import sys
import numpy as np
import torch
import triton
from triton.runtime import interpreter
from attention import fps_triton
from attention.pointops import farthest_point_sample, fma32

assert triton.knobs.runtime.interpret and isinstance(fps_triton._fps_kernel, interpreter.InterpretedFunction)


def fused_multiply_add(self, x, y, z):  # rounded once, as the GPU's fma.rn.f32 (the interpreter rounds twice)
    assert x.data.dtype == y.data.dtype == z.data.dtype == np.float32
    out = fma32(*(torch.from_numpy(np.ascontiguousarray(v.data)) for v in (x, y, z))).numpy()
    return interpreter.TensorHandle(out, z.dtype.scalar)


interpreter.InterpreterBuilder.create_fma = fused_multiply_add
torch.set_num_threads(1)
cases, out = torch.load(sys.argv[1]), {}
defaults = fps_triton.MAX_ONE_BLOCK, fps_triton.CHUNK
for name, case in cases.items():
    fps_triton.MAX_ONE_BLOCK, fps_triton.CHUNK = (0, case["chunk"]) if case["chunk"] else defaults
    out[name] = farthest_point_sample(case["xyz"], case["m"], case["start"], case["like_kernel"], backend="triton")
    if not case["chunk"]:  # the points in registers: also with each argmax carrying the centre's coordinates
        fps_triton.CARRY = True
        out[name + "|carry"] = farthest_point_sample(case["xyz"], case["m"], case["start"], case["like_kernel"],
                                                     backend="triton")
        fps_triton.CARRY = False
torch.save(out, sys.argv[2])
"""


def grid_points(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(2, 64, 3) the integer grid {0..3}^3 in two orders, point 10 a copy of point 11: every squared distance is
    an integer, exact in float32, and tied many times over; (0, 0, 0) is a point the CUDA kernel skips."""
    grid = torch.cartesian_prod(*[torch.arange(4)] * 3).to(dtype)  # (64, 3)
    g = torch.Generator().manual_seed(seed)
    points = torch.stack([grid, grid[torch.randperm(64, generator=g)]])  # (2, 64, 3)
    points[:, 10] = points[:, 11]
    return points


def random_points(b: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(b, n, 3) uniform in [-1, 1]^3, point 3 near the origin (skipped by the CUDA kernel), point 0 at it."""
    g = torch.Generator().manual_seed(seed)
    xyz = torch.rand(b, n, 3, generator=g, dtype=torch.float64).to(dtype) * 2 - 1
    xyz[:, 3] = 0.01
    xyz[:, 0] = 0.0
    return xyz


def shell_points(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(3, 48, 3): point 0 at (3, -2, 5), the others about 1 away from it, rounded to ``dtype``: their squared
    distances differ in the last bits, so the picks depend on each rounding (an FMA, or another order of the
    sum, picks other points)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(3, 48, 3, generator=g, dtype=torch.float64)
    xyz = torch.tensor([3.0, -2.0, 5.0], dtype=torch.float64) + u / u.norm(dim=-1, keepdim=True)
    xyz[:, 0] = torch.tensor([3.0, -2.0, 5.0])
    return xyz.to(dtype)


def cases() -> dict:
    """name -> dict(xyz, m, start, like_kernel, chunk): chunk 0 keeps a sample's points in registers, 32 sweeps
    them in chunks of 32 (64 points: 2 chunks, tied across them; 70: 2 and a bit)."""
    f32, f64 = torch.float32, torch.float64
    same = torch.full((2, 9, 3), 0.5)  # nine copies of one point: every distance 0 after the first step
    line = torch.tensor([[[1.0, 0, 0], [0.02, 0, 0], [-1.0, 0, 0]]])  # only a skipped point left: point 0 again
    near_origin = torch.zeros(1, 6, 3)
    near_origin[0, 2, 0] = 1.0
    out = {}
    for chunk in (0, 32):
        tag = f"chunk{chunk}" if chunk else "block"

        def add(name, xyz, m, start=0, like_kernel=False):
            out[f"{tag}-{name}"] = dict(xyz=xyz, m=m, start=start, like_kernel=like_kernel, chunk=chunk)

        for dtype, name in ((f32, "f32"), (f64, "f64")):
            rand = random_points(3, 70 if chunk else 40, dtype, seed=len(out))
            grid = grid_points(dtype, seed=len(out))
            add(f"random-{name}", rand, 12)
            add(f"random-{name}-start", rand, 12, torch.tensor([5, 0, rand.shape[1] - 1]))
            add(f"random-{name}-kernel", rand, 12, like_kernel=True)
            add(f"grid-{name}", grid, 24, 7)
            add(f"grid-{name}-start", grid, 24, torch.tensor([10, 63]))
            add(f"grid-{name}-kernel", grid, 24, like_kernel=True)
            add(f"shell-{name}", shell_points(dtype, seed=len(out)), 8)
            add(f"shell-{name}-kernel", shell_points(dtype, seed=len(out)), 8, like_kernel=True)
        # pointnet2_ops' fused multiply-adds pick other points here than the same rule with every product rounded
        u = torch.randn(2, 100, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        shell = torch.tensor([3.0, -2.0, 5.0], dtype=torch.float64) + u / u.norm(dim=-1, keepdim=True)
        shell[:, 0] = torch.tensor([3.0, -2.0, 5.0])
        add("fused-shell-kernel", shell.float(), 20, like_kernel=True)
        add("fused-linspace-grid-kernel", torch.cartesian_prod(*[torch.linspace(-1, 1, 6)] * 3)[None], 20,
            like_kernel=True)
        add("same", same, 9, 4)
        add("same-kernel", same, 5, like_kernel=True)
        add("line-kernel", line, 3, like_kernel=True)
        add("near-origin-kernel", near_origin, 4, like_kernel=True)
        add("origin-only-kernel", torch.zeros(1, 5, 3), 3, like_kernel=True)
        if chunk:  # the layout of the input and m = 1 are the wrapper's: once is enough
            continue
        # a (B, N, 3) view of (B, 3, N) planes, not contiguous; every point picked
        add("strided", random_points(2, 33, f32, 9).transpose(1, 2).contiguous().transpose(1, 2), 33,
            torch.tensor([32, 1]))
        add("one-point", torch.rand(2, 1, 3, generator=torch.Generator().manual_seed(1)), 1)
    return out


CASES = cases()


def brute_force(xyz: torch.Tensor, m: int, start: int) -> list[int]:
    """Plain farthest point sampling in float64, one point at a time; ties to the lowest index."""
    xyz = xyz.double()
    chosen, dist = [start], torch.full((len(xyz),), float("inf"), dtype=torch.float64)
    for _ in range(m - 1):
        dist = torch.minimum(dist, ((xyz - xyz[chosen[-1]]) ** 2).sum(-1))
        chosen.append(max(range(len(xyz)), key=lambda i: (dist[i], -i)))
    return chosen


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's indices from the Triton kernel, run by the interpreter in one subprocess."""
    folder = tmp_path_factory.mktemp("fps_triton")
    torch.save(CASES, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRET, str(folder / "cases.pt"), str(folder / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        pytest.fail(f"the interpreted kernel failed (Triton is in the lock, so it must import):\n{done.stderr}")
    return torch.load(folder / "out.pt")


def unfused_like_kernel(xyz: torch.Tensor, m: int) -> torch.Tensor:
    """like_kernel's rule with every product rounded, no fused multiply-add: (B, m)."""
    order = pointops.kernel_order(xyz.shape[1])
    points = xyz[:, order]
    kept = points.square().sum(-1) > pointops.KERNEL_MIN_SQUARED_NORM
    return order[pointops.fps_loop(points, m, torch.zeros(len(xyz), dtype=torch.long),
                                   torch.where(kept, 1e10, -1.0).to(xyz.dtype))]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_torch_loop(interpreted, name):
    case = CASES[name]
    want = farthest_point_sample(case["xyz"], case["m"], case["start"], case["like_kernel"], backend="torch")
    assert interpreted[name].dtype == torch.long
    assert interpreted[name].tolist() == want.tolist()
    if not case["chunk"]:  # fps_triton.CARRY: the same picks with the centre carried through each argmax
        assert interpreted[name + "|carry"].tolist() == want.tolist()
    if "fused" in name:  # a kernel without the fused multiply-adds would fail here
        assert not torch.equal(want, unfused_like_kernel(case["xyz"], case["m"]))
    if not case["like_kernel"] and ("grid" in name or "f64" in name):  # exact distances: the float64 rule too
        starts = case["start"].tolist() if isinstance(case["start"], torch.Tensor) else [case["start"]] * len(want)
        assert want.tolist() == [brute_force(x, case["m"], s) for x, s in zip(case["xyz"], starts)]


# Runs in a subprocess with a scratch Triton cache: catches the options each launch of the kernel passes (float32
# and float64, in registers and in chunks, plain and like_kernel), compiles it with them for an H100 (sm_90), which
# needs no GPU, and prints, per launch, its options and the float arithmetic of the PTX as (op, dest, args) rows.
COMPILE = """
import json
import re
import sys
import torch
from attention import fps_triton
from attention.pointops import farthest_point_sample

sys.path.insert(0, "tests")
from triton_sm90 import compile_launch

launches = []

def run(*args, grid, warmup, **options):  # records the launch, returns indices 0
    launches.append((args, options))
    args[5].zero_()  # out


fps_triton._fps_kernel.run = run
for dtype, n in [(torch.float32, 1000), (torch.float32, 9000), (torch.float64, 1000), (torch.float64, 5000)]:
    for like_kernel in (False, True):
        farthest_point_sample(torch.rand(2, n, 3, dtype=dtype), 4, like_kernel=like_kernel, backend="triton")
for args, options in launches:
    name = {torch.float32: "fp32", torch.float64: "fp64"}[args[0].dtype]
    constexprs = {k: options[k] for k in ("BLOCK", "ONE_BLOCK", "FUSED", "SKIP", "MIN_MAG", "PERMUTED")}
    ptx = compile_launch(fps_triton._fps_kernel, args, options).asm["ptx"]
    ops = re.findall(r"^\\s*((?:fma|mul|add|sub)\\.\\S*f(?:32|64))\\s+(%\\w+),\\s*([^;]*);", ptx, re.M)
    print(json.dumps(dict(dtype=name, fusion=options["enable_fp_fusion"], **constexprs,
                          ops=[(op, dest, [a.strip() for a in args.split(",")]) for op, dest, args in ops])))
"""


def fused_nesting(ops: list) -> set:
    """The shapes of the fused multiply-adds in PTX float ops [(op, dest, args)]: for each fma whose addend is
    another fma's result, ('fma(a, a, fma(b, b, mul(c, c)))' with a, b, c differences from three different
    centres, the same of the coordinates themselves: a squared norm) or a description of whatever else it is."""
    made = {dest: (op, args) for op, dest, args in ops}
    shapes = set()
    for op, dest, args in ops:
        if not op.startswith("fma") or not made.get(args[2], ("",))[0].startswith("fma"):
            continue
        inner_op, inner = made[args[2]]
        mul_op, mul = made.get(inner[2], ("?", [None] * 3))
        squares = args[0] == args[1] and inner[0] == inner[1] and mul[0] == mul[1]
        diffs = [made.get(r, ("?", [None, None])) for r in (args[0], inner[0], mul[0])]
        centres = {d[1][1] for d in diffs if d[0].startswith("sub")}
        if op == inner_op == "fma.rn.f32" and mul_op == "mul.rn.f32" and squares and len(centres) == 3:
            shapes.add("fma(a, a, fma(b, b, mul(c, c)))")
        elif op == inner_op == "fma.rn.f32" and mul_op == "mul.rn.f32" and squares and not centres:
            shapes.add("fma(z, z, fma(x, x, mul(y, y))) of the points")  # the skipped points' squared norm
        else:
            shapes.add(f"{op}({args}) of {inner_op}({inner}) of {mul_op}({mul})")
    return shapes


def test_kernel_compiles_for_sm90_as_the_gpu_runs_it(tmp_path):
    # On a GPU, fusing dx*dx + dy*dy into one rounding would give other distances than the torch loop's (the shell
    # cases above pick other points), and the interpreter cannot show it: each launch must pass
    # enable_fp_fusion=False, so that the plain kernel's PTX holds no fma; like_kernel's holds exactly nvcc's
    # contraction of pointnet2_ops' source (read from nvcc 13.0's PTX for sm_90: mul.f32 of dy, fma.rn.f32 of dx,
    # fma.rn.f32 of dz), each squared distance one fma(dz, dz, fma(dx, dx, dy*dy)), written out with tl.fma.
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    # like_kernel's launches (the second of each pair) permute the points themselves (PERMUTED)
    assert [(r["dtype"], r["ONE_BLOCK"], r["FUSED"], r["SKIP"], r["PERMUTED"]) for r in rows] == [
        ("fp32", True, False, False, False), ("fp32", True, True, True, True), ("fp32", False, False, False, False),
        ("fp32", False, True, True, True), ("fp64", True, False, False, False), ("fp64", True, False, False, True),
        ("fp64", False, False, False, False), ("fp64", False, False, False, True)]
    for r in rows:
        ops = [op for op, _, _ in r["ops"]]
        assert r["fusion"] is False and any(op.startswith("mul.rn.") for op in ops)
        if r["FUSED"]:  # like_kernel: its distances, and the skipped points' test made in the kernel (SKIP)
            fmas = [op for op in ops if op.startswith("fma")]
            assert fmas and len(fmas) == 2 * ops.count("mul.rn.f32") and set(fmas) == {"fma.rn.f32"}
            assert fused_nesting(r["ops"]) == {"fma(a, a, fma(b, b, mul(c, c)))",
                                               "fma(z, z, fma(x, x, mul(y, y))) of the points"}
            assert r["MIN_MAG"] == pointops.KERNEL_MIN_MAG32
        else:
            assert not any(op.startswith("fma") for op in ops), r


# Records the launches farthest_point_sample makes at the sizes of pct_cuda's FPS rows (and float64's largest in
# registers and in chunks) with the warps of fps_triton.warps_for, compiles each for sm_90 and prints its resources.
RESOURCES = """
import json
import sys
import torch
from attention import fps_triton
from attention.pointops import farthest_point_sample

sys.path.insert(0, "tests")
from triton_sm90 import compile_sm90

launches = []


def run(*args, grid, warmup, **options):  # records the launch, returns indices 0
    launches.append((fps_triton._fps_kernel, args, options))
    args[5].zero_()  # out


fps_triton._fps_kernel.run = run
for carry, dtype, n in [(False, torch.float32, 512), (False, torch.float32, 1024), (False, torch.float32, 2048),
                        (False, torch.float32, 8192), (False, torch.float32, 65536), (False, torch.float64, 4096),
                        (False, torch.float64, 8192), (True, torch.float32, 512), (True, torch.float32, 8192),
                        (True, torch.float64, 4096)]:
    del launches[:]
    fps_triton.CARRY = carry
    farthest_point_sample(torch.rand(2, n, 3, dtype=dtype), 4, like_kernel=dtype == torch.float32, backend="triton")
    for kernel, args, options in launches:
        print(json.dumps(dict(n=n, dtype=str(dtype), warps=options["num_warps"], carry=options["CARRY"],
                              **compile_sm90(kernel, args, options))))
"""


def test_default_warps_hold_the_points_in_registers_without_spills(tmp_path):
    """The warps the rule picks (1 at 512 points to 8 from 4,096, what two H200 leases measured fastest) leave the
    compiled kernel within the register file: no stack, no local memory (1 warp at 2,048 or 4 at 8,192 would spill);
    so does fps_triton.CARRY's reduction over five values at the sizes it takes (the points in registers)."""
    from triton_sm90 import compiled_rows

    rows = compiled_rows(RESOURCES, tmp_path)
    assert [(r["n"], r["warps"], r["carry"]) for r in rows] == [
        (512, 1, False), (1024, 2, False), (2048, 4, False), (8192, 8, False), (65536, 8, False), (4096, 8, False),
        (8192, 8, False), (512, 1, True), (8192, 8, True), (4096, 8, True)]
    for r in rows:
        assert r["STACK"] == 0 and r["LOCAL"] == 0 and r["REG"] <= 255, r


def test_auto_takes_the_torch_loop_on_the_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("backend='auto' launched the Triton kernel for CPU tensors")

    monkeypatch.setattr(pointops.FPS_KERNELS, "call", no_kernel)
    monkeypatch.setattr(triton_kernels, "AVAILABLE", True)
    xyz = grid_points(torch.float32, seed=0)
    for like_kernel in (False, True):
        assert torch.equal(farthest_point_sample(xyz, 20, like_kernel=like_kernel),
                           farthest_point_sample(xyz, 20, like_kernel=like_kernel, backend="torch"))


def test_without_triton_auto_still_works(monkeypatch):
    import attention

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "attention.fps_triton", raising=False)
    monkeypatch.delattr(attention, "fps_triton", raising=False)
    monkeypatch.setattr(triton_kernels, "AVAILABLE", None)
    assert not triton_kernels.available()
    xyz = grid_points(torch.float32, seed=1)
    want = farthest_point_sample(xyz, 20, backend="torch")
    assert torch.equal(farthest_point_sample(xyz, 20), want)
    with pytest.raises(ImportError):
        farthest_point_sample(xyz, 20, backend="triton")
    # a kernel that fails under backend="auto" (on a GPU) warns, is turned off, and the torch loop takes over
    monkeypatch.setattr(triton_kernels, "AVAILABLE", True)
    monkeypatch.setattr(pointops.FPS_KERNELS, "usable", True)
    start, dist = torch.zeros(2, dtype=torch.long), torch.full((2, 64), torch.inf)
    with pytest.warns(UserWarning, match="torch loop takes over"):
        assert pointops.FPS_KERNELS.call("farthest_point_sample", xyz, 20, start, dist) is None
    assert pointops.FPS_KERNELS.usable is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(farthest_point_sample(xyz, 20), want)


def test_kernel_takes_float32_and_float64_only():
    from attention import fps_triton  # imports Triton, launches nothing

    xyz = grid_points(torch.float16, seed=2)
    with pytest.raises(ValueError, match="float32 or float64"):
        fps_triton.farthest_point_sample(xyz, 4, torch.zeros(2, dtype=torch.long), torch.full((2, 64), torch.inf))


def unit_ball_points(b: int, n: int, seed: int) -> torch.Tensor:
    """(b, n, 3) float32 from normalised Gaussians (full 24-bit mantissas, unlike torch.rand's multiples of 2^-24,
    so the torch path's float64 sums can be inexact and its halfway test runs), point 0 at the origin."""
    g = torch.Generator().manual_seed(seed)
    xyz = torch.randn(b, n, 3, generator=g, dtype=torch.float64)
    xyz = xyz / xyz.norm(dim=-1).amax(-1)[:, None, None]
    xyz[:, 0] = 0.0
    return xyz.float()


# (B, N, m): PCT's two samplings, the sizes where the unfused kernel departed from pointnet2_ops on an H100
# (issue 27 §5), up to 65,536 points
GPU_SIZES = [(32, 1024, 512), (32, 512, 256), (16, 2048, 1024), (8, 8192, 2048), (2, 65536, 8192)]


def gpu_cases() -> list:
    """[(name, xyz (B, N, 3) float32, m)]: uniform points with one near the origin, full-mantissa points, and
    regular grids (16^3 and 40^3 points of linspace(-1, 1): ties everywhere, broken by the FMA's rounding)."""
    out = []
    for b, n, m in GPU_SIZES:
        out.append((f"uniform-{b}x{n}", random_points(b, n, torch.float32, seed=n), m))
        out.append((f"ball-{b}x{n}", unit_ball_points(b, n, seed=n), m))
    for k, m in [(16, 1024), (40, 8192)]:
        out.append((f"grid-{k}^3", torch.cartesian_prod(*[torch.linspace(-1, 1, k)] * 3)[None], m))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("carry", [False, True])
def test_kernel_on_the_gpu_equals_the_torch_path(monkeypatch, carry):
    # the Triton kernel compiled for the GPU (tl.fma: fma.rn.f32) against the torch path's emulation, on the CPU
    # (on the GPU above 8,192 points: 8,192 steps of the CPU loop over 65,536 points take minutes); also with each
    # argmax carrying the next centre (fps_triton.CARRY, where the points fit in registers)
    from attention import fps_triton

    monkeypatch.setattr(fps_triton, "CARRY", carry)
    for name, xyz, m in gpu_cases():
        want = farthest_point_sample(xyz if xyz.shape[1] <= 8192 else xyz.cuda(), m, like_kernel=True,
                                     backend="torch").cpu()
        got = farthest_point_sample(xyz.cuda(), m, like_kernel=True, backend="triton")
        assert torch.equal(got.cpu(), want), name
        plain = farthest_point_sample(xyz, m // 4, backend="torch")
        assert torch.equal(farthest_point_sample(xyz.cuda(), m // 4, backend="triton").cpu(), plain), name


@pytest.mark.cuda
def test_like_kernel_equals_pointnet2_ops():
    # the real op: pointnet2_ops built from PCT_Pytorch's sources with nvcc's defaults. A reference, not a
    # dependency of the suite, so a GPU machine without it skips this one test, saying how to build it
    try:
        from pointnet2_ops import pointnet2_utils
    except Exception as error:  # not built: ImportError, or its fallback's JIT build failing (a RuntimeError)
        pytest.skip(f"pointnet2_ops is not importable ({type(error).__name__}: {str(error)[:200]}): build "
                    "PCT_Pytorch's pointnet2_ops_lib with `python setup.py build_ext --inplace` (TORCH_CUDA_ARCH_LIST naming this GPU) and put it on "
                    "PYTHONPATH to compare like_kernel with the real op")
    for name, xyz, m in gpu_cases():
        want = pointnet2_utils.furthest_point_sample(xyz.cuda().contiguous(), m).long().cpu()  # (B, m) int32 -> long
        assert torch.equal(farthest_point_sample(xyz.cuda(), m, like_kernel=True).cpu(), want), name
        if xyz.shape[1] <= 8192:
            assert torch.equal(farthest_point_sample(xyz, m, like_kernel=True, backend="torch"), want), name


def test_kernel_order_is_made_once_per_size_and_device():
    # like_kernel reads it in every forward; made afresh, it was a CPU tensor copied to the GPU each time
    first = pointops.kernel_order(1000, "cpu")
    assert pointops.kernel_order(1000, torch.device("cpu")) is first
    assert pointops.kernel_order(1024, "cpu") is not first and len(pointops.kernel_order(1024, "cpu")) == 1024
    assert sorted(first.tolist()) == list(range(1000)) and first[0] == 0
