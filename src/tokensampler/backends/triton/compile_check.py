"""Compile the step's kernels for a CUDA target without a GPU, and report what the PTX contains.

    python -m tokensampler.backends.triton.compile_check [--arch 90]     # prints one JSON object

Triton's front end, LLVM and the bundled ptxas run on any machine, so a CPU-only CI can check
that every kernel compiles for the GPU (the interpreter does not type-check like the compiler),
that divisions are correctly rounded (`div.rn.f32`, no `div.full`/`div.approx`), that no float32
multiply-add was contracted into an FMA (`enable_fp_fusion=False`) and that nothing spills to
local memory. Must run in a process where TRITON_INTERPRET is not set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

PTX_PATTERNS = {"div_rn_f32": r"div\.rn\.f32", "div_inexact_f32": r"div\.(full|approx)\.f32",
                "fma_f32": r"fma\.rn\.f32", "local_memory": r"\.local"}

PREPARE_TYPES = dict(logits_ptr="*bf16", logits_stride="i32", slot_ptr="*i64", z_ptr="*fp32", fstat_ptr="*fp32",
                     istat_ptr="*i64", prompt_ptr="*i1", counts_ptr="*i32", bias_ptr="*fp32", allowed_ptr="*i1",
                     stop_ptr="*i1", output_len_ptr="*i64", min_tokens_ptr="*i64", repetition_ptr="*fp32",
                     frequency_ptr="*fp32", presence_ptr="*fp32", bitmask_ptr="*i32", bitmask_stride="i32",
                     words_ptr="*i64", recent_ptr="*i64", num_words="i32", word_length="i32", vocab="i32",
                     chunk="i32")
SELECT_TYPES = dict(z_ptr="*fp32", slot_ptr="*i64", fstat_ptr="*fp32", istat_ptr="*i64", temperature_ptr="*fp32",
                    top_k_ptr="*i64", top_p_ptr="*fp64", min_p_ptr="*fp32", seed_ptr="*i64", position_ptr="*i64",
                    stream_ptr="*i64", counts_ptr="*i32", output_len_ptr="*i64", record_ptr="*i1", token_ptr="*i64",
                    valid_ptr="*i1", list_key_ptr="*i64", list_p_ptr="*fp32",
                    info_f_ptr="*fp32", info_i_ptr="*i64", recent_ptr="*i64", depth="i32", vocab="i32")
LOGPROBS_TYPES = dict(logits_ptr="*fp16", logits_stride="i32", z_ptr="*fp32", token_ptr="*i64", num_ptr="*i64",
                      info_f_ptr="*fp32", info_i_ptr="*i64", token_lp_ptr="*fp32", rank_ptr="*i64",
                      top_id_ptr="*i64", top_lp_ptr="*fp32", vocab="i32", top_stride="i32")


def variants():
    """(name, kernel, argument types, constexprs): every kernel with every optional step switched on."""
    from . import kernels as step
    yield ("prepare", step.prepare_kernel, PREPARE_TYPES,
           dict(HAS_ALLOWED=True, HAS_STOP=True, HAS_BIAS=True, HAS_PENALTIES=True, HAS_BITMASK=True,
                HAS_BAD_WORDS=True, WPAD=8, LPAD=4, BLOCK=1024, NSPLIT=4))
    yield ("select", step.select_kernel, SELECT_TYPES,
           dict(HAS_MIN_P=True, HAS_TOP_K=True, HAS_TOP_P=True, HAS_RECORD=True, HAS_RECENT=True, DPAD=4,
                BLOCK=512, NSPLIT=4, NPIV=16,
                CAP=4096, LBLOCK=512))
    yield ("logprobs", step.logprobs_kernel, LOGPROBS_TYPES,
           dict(PROCESSED=True, AS_LOGPROBS=True, HAS_MIN_P=True, WIDTH=20, WPAD=32, BLOCK=1024))


def compile_all(arch: int = 90) -> dict:
    """{kernel name: {pattern: count in the PTX}} for every variant, compiled for sm_`arch`."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs a process without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton

    target = GPUTarget("cuda", arch, 32)
    report = {}
    for name, kernel, types, constexprs in variants():
        signature = {arg: "constexpr" if arg in constexprs else types[arg] for arg in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                                  options={"num_warps": 8, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        report[name] = {key: len(re.findall(pattern, ptx)) for key, pattern in PTX_PATTERNS.items()}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the kernels for a CUDA arch without a GPU")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    json.dump(compile_all(args.arch), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
