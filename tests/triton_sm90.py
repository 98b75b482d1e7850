"""The suite's Triton kernels compiled for an H100 without one, exactly as their wrappers launch them: what the
kernel tests' subprocesses import (tests/attention/test_dilated_triton.py, test_index_attention_triton.py).

:func:`record_launches` replaces each kernel's launch by a recorder, so that calling a wrapper (``forward``,
``backward``) on empty CPU tensors records each launch's arguments and options instead of running it;
:func:`compile_sm90` then specialises the arguments as Triton's launcher does (alignment, constexprs), compiles for
sm_90 and reads the PTX (atomic instructions, global loads) and the cubin's resource usage (registers, spills).
"""

from __future__ import annotations

import re
import subprocess
import tempfile

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource


def record_launches(*kernels) -> list:
    """The list every later launch of ``kernels`` appends (kernel, args, options) to, instead of running."""
    launches = []
    for kernel in kernels:
        def run(*args, grid, warmup, _kernel=kernel, **options):
            launches.append((_kernel, args, options))
        kernel.run = run
    return launches


def compile_launch(kernel, args, options):
    """One recorded launch compiled for sm_90 (``triton.compile``'s result): its arguments specialised as Triton's
    launcher does, its ``num_warps`` and (where the launch passes it) ``enable_fp_fusion``."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (arg_name, arg) in enumerate(zip(kernel.arg_names, args)):
        kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[arg_name] = kind
        if kind == "constexpr":
            constexprs[arg_name] = key
        elif isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    for arg_name in kernel.arg_names[len(args):]:
        signature[arg_name], constexprs[arg_name] = "constexpr", options[arg_name]
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={k: options[k] for k in ("num_warps", "enable_fp_fusion") if k in options})


def compile_sm90(kernel, args, options) -> dict:
    """{kernel, constexprs (the upper-case ones), atomics, loads, REG, STACK, LOCAL} of one recorded launch."""
    compiled = compile_launch(kernel, args, options)
    constexprs = {name: options[name] for name in kernel.arg_names[len(args):]}
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    resources = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return dict(kernel=kernel.__name__, constexprs={k: v for k, v in constexprs.items() if k.isupper()},
                atomics=re.findall(r"\b(?:atom|red)\.[\w.]+", ptx),
                loads=sorted(set(re.findall(r"ld\.global[\w.]*", ptx))), **resources)


def compiled_rows(script: str, tmp_path) -> list[dict]:
    """Run ``script`` (which prints one JSON row a compiled launch) in a subprocess from the checkout, with Triton's
    cache in ``tmp_path`` and the interpreter off, and return its rows."""
    import json
    import os
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
