"""The Triton farthest point sampling kernel (attention/fps_triton.py) against the torch loop, index for index.

The kernel runs on CPU tensors under Triton's interpreter, which ``TRITON_INTERPRET=1`` turns on when the kernel
is defined (at import), so it runs in a subprocess: the setting then reaches no other test of this worker. The
interpreter rounds each float32/float64 operation as the GPU does with ``enable_fp_fusion=False``;
:func:`test_kernel_compiles_for_sm90_without_fused_multiply_add` checks, without a GPU, that the code compiled for
one has no fused multiply-add either. Triton is in the lock: if it does not import, these tests fail.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attention import pointops
from attention.pointops import farthest_point_sample

ROOT = Path(__file__).resolve().parents[2]

# Runs in the subprocess: reads the cases, runs the kernel under the interpreter, writes what it returned.
INTERPRET = """
import sys
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from attention import fps_triton
from attention.pointops import farthest_point_sample

assert triton.knobs.runtime.interpret and isinstance(fps_triton._fps_kernel, InterpretedFunction)
torch.set_num_threads(1)
cases, out = torch.load(sys.argv[1]), {}
defaults = fps_triton.MAX_ONE_BLOCK, fps_triton.CHUNK
for name, case in cases.items():
    fps_triton.MAX_ONE_BLOCK, fps_triton.CHUNK = (0, case["chunk"]) if case["chunk"] else defaults
    out[name] = farthest_point_sample(case["xyz"], case["m"], case["start"], case["like_kernel"], backend="triton")
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


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_torch_loop(interpreted, name):
    case = CASES[name]
    want = farthest_point_sample(case["xyz"], case["m"], case["start"], case["like_kernel"], backend="torch")
    assert interpreted[name].dtype == torch.long
    assert interpreted[name].tolist() == want.tolist()
    if not case["like_kernel"] and ("grid" in name or "f64" in name):  # exact distances: the float64 rule too
        starts = case["start"].tolist() if isinstance(case["start"], torch.Tensor) else [case["start"]] * len(want)
        assert want.tolist() == [brute_force(x, case["m"], s) for x, s in zip(case["xyz"], starts)]


# Runs in a subprocess with a scratch Triton cache: catches the options each launch of the kernel passes (float32
# and float64, in registers and in chunks), compiles it with them for an H100 (sm_90), which needs no GPU, and
# prints the fused multiply-adds and rounded multiplications in the PTX; the last line turns fusion on.
COMPILE = """
import re
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attention import fps_triton
from attention.pointops import farthest_point_sample

launches = []
fps_triton._fps_kernel.run = lambda *args, grid, warmup, **options: launches.append((args[0].dtype, options))
for dtype, n in [(torch.float32, 1000), (torch.float32, 9000), (torch.float64, 1000), (torch.float64, 5000)]:
    farthest_point_sample(torch.rand(2, n, 3, dtype=dtype), 4, backend="triton")
launches.append((torch.float32, {**launches[0][1], "enable_fp_fusion": True}))
for dtype, options in launches:
    name = {torch.float32: "fp32", torch.float64: "fp64"}[dtype]
    signature = {"planes_ptr": "*" + name, "dist_ptr": "*" + name, "start_ptr": "*i64", "out_ptr": "*i64",
                 "n": "i32", "m": "i32", "BLOCK": "constexpr", "ONE_BLOCK": "constexpr"}
    source = ASTSource(fps_triton._fps_kernel, signature,
                       constexprs={"BLOCK": options["BLOCK"], "ONE_BLOCK": options["ONE_BLOCK"]})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={k: options[k] for k in ("num_warps", "enable_fp_fusion")}).asm["ptx"]
    print(name, options["ONE_BLOCK"], options["enable_fp_fusion"], len(re.findall(r"\\bfma\\.", ptx)),
          len(re.findall(r"\\bmul\\.rn\\.", ptx)))
"""


def test_kernel_compiles_for_sm90_without_fused_multiply_add(tmp_path):
    # On a GPU, fusing dx*dx + dy*dy into one rounding would give other distances than the torch loop's (with
    # FMAs emulated in float64, the shell cases above pick other points), and the interpreter cannot show it:
    # each launch must pass enable_fp_fusion=False, and the PTX compiled with its options hold no fma.
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [row[:2] for row in rows] == [["fp32", "True"], ["fp32", "False"], ["fp64", "True"], ["fp64", "False"],
                                         ["fp32", "True"]]
    for name, one_block, fusion, fma, mul_rn in rows[:-1]:
        assert (fusion, fma) == ("False", "0") and int(mul_rn) >= 3, (name, one_block)
    assert int(rows[-1][3]) > 0  # the count sees fused multiply-adds where fusion is on


def test_auto_takes_the_torch_loop_on_the_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("backend='auto' launched the Triton kernel for CPU tensors")

    monkeypatch.setattr(pointops, "fps_triton", no_kernel)
    monkeypatch.setattr(pointops, "TRITON_USABLE", True)
    xyz = grid_points(torch.float32, seed=0)
    for like_kernel in (False, True):
        assert torch.equal(farthest_point_sample(xyz, 20, like_kernel=like_kernel),
                           farthest_point_sample(xyz, 20, like_kernel=like_kernel, backend="torch"))


def test_without_triton_auto_still_works(monkeypatch):
    import attention

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "attention.fps_triton", raising=False)
    monkeypatch.delattr(attention, "fps_triton", raising=False)
    monkeypatch.setattr(pointops, "TRITON_USABLE", None)
    assert not pointops.triton_usable()
    xyz = grid_points(torch.float32, seed=1)
    want = farthest_point_sample(xyz, 20, backend="torch")
    assert torch.equal(farthest_point_sample(xyz, 20), want)
    with pytest.raises(ImportError):
        farthest_point_sample(xyz, 20, backend="triton")
    # a kernel that fails under backend="auto" (on a GPU) warns, is turned off, and the torch loop takes over
    monkeypatch.setattr(pointops, "TRITON_USABLE", True)
    start, dist = torch.zeros(2, dtype=torch.long), torch.full((2, 64), torch.inf)
    with pytest.warns(UserWarning, match="torch loop takes over"):
        assert pointops.fps_triton(xyz, 20, start, dist, fallback=True) is None
    assert pointops.TRITON_USABLE is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(farthest_point_sample(xyz, 20), want)


def test_kernel_takes_float32_and_float64_only():
    from attention import fps_triton  # imports Triton, launches nothing

    xyz = grid_points(torch.float16, seed=2)
    with pytest.raises(ValueError, match="float32 or float64"):
        fps_triton.farthest_point_sample(xyz, 4, torch.zeros(2, dtype=torch.long), torch.full((2, 64), torch.inf))
