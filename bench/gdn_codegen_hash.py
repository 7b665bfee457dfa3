"""Whether a Gated DeltaNet kernel edit changes machine code, without a GPU: the sha256 of
the cubin a local ptxas makes of each kernel's PTX (its .loc / .file / comment lines
stripped, the .version lowered to 9.0 for CUDA 13.0's ptxas) for three forward and two
backward configurations (every mode but seq_table, chunk_grad and finish) and the fused
kernel. Run before and after a refactor and diff the outputs:

    python bench/gdn_codegen_hash.py [--chunk-grad] > before.txt   (from the repo root;
    ptxas at /usr/local/bin/ptxas)

--chunk-grad adds the backward's chunk_grad (its compile takes a few minutes).
"""
import hashlib, os, re, shutil, subprocess, sys, tempfile
from pathlib import Path
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.getcwd())
import torch
import cutlass
import cutlass.cute as cute
from precast.lifecycle import gdn_fwd
from precast.lifecycle.gdn_fwd import GdnFwdSm90
from precast.lifecycle.gdn_bwd import GdnBwdSm90


def digest(fn, args, tag):
    d = Path(tempfile.mkdtemp())
    cute.compile(fn, *args, options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-ptx --dump-dir {d}")
    for ptx in sorted(d.glob("*.ptx")):
        text = ptx.read_text()
        text = re.sub(r"^\.version \d+\.\d+", ".version 9.0", text, count=1, flags=re.M)
        text = "\n".join(l for l in text.splitlines()
                         if not l.lstrip().startswith((".loc", ".file", "//")))
        p = d / "x.ptx"
        p.write_text(text)
        subprocess.run(["/usr/local/bin/ptxas", "-arch=sm_90a", str(p), "-o", str(d / "x.cubin")],
                       check=True)
        print(tag, hashlib.sha256((d / "x.cubin").read_bytes()).hexdigest()[:16], flush=True)
    shutil.rmtree(d)


FWD = [dict(state_dtype="float32", output_final_state=True, checkpoint_dtype="io",
            use_qk_l2norm_in_kernel=True),
       dict(output_final_state=True, use_qk_l2norm_in_kernel=True),
       dict(k_dim=64, v_dim=64, state_dtype="io", state_pool=True)]
BWD = [dict(k_dim=128, v_dim=128, q_heads=4, k_heads=4, v_heads=4, use_qk_l2norm_in_kernel=True,
            state_dtype="float32", checkpoint_dtype="float32"),
       dict(k_dim=128, v_dim=128, q_heads=16, k_heads=16, v_heads=64,
            use_qk_l2norm_in_kernel=True, beta_dtype="bfloat16")]
for i, cfg in enumerate(FWD):
    op = GdnFwdSm90.from_config(**cfg).check_support()
    for mode, build in op._kernel_builders().items():
        if mode != "seq_table":
            digest(*build(), f"fwd{i} {mode}")
for i, cfg in enumerate(BWD):
    op = GdnBwdSm90.from_config(**cfg).check_support()
    for mode, build in op._kernel_builders().items():
        skipped = ("seq_table", "finish") + (() if "--chunk-grad" in sys.argv else ("chunk_grad",))
        if mode not in skipped:
            digest(*build(), f"bwd{i} {mode}")
# the fused kernel (as tests/test_gdn_fused_compile.py builds it)
from precast.kernels.fake import fake_stream, fake_tokens, scalar
from precast.kernels.gdn_fwd_sm90 import GdnForwardSm90
op = GdnFwdSm90.from_config(state_dtype="float32", output_final_state=True,
                            checkpoint_dtype="float32", use_qk_l2norm_in_kernel=True).check_support()
s = op.shapes
io = cutlass.BFloat16
kernel = GdnForwardSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, True, cutlass.Float32, cutlass.Float32,
                        True, False, True, True)
tokens = cute.sym_int()
args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
        fake_tokens(io, tokens, s.HV, s.V), gdn_fwd._fake_gate(torch.float32, tokens, s.HO),
        gdn_fwd._fake_gate(torch.float32, tokens, s.HO), gdn_fwd._fake_offsets(),
        fake_tokens(io, tokens, s.HO, s.V), gdn_fwd._fake_state(s.state_dtype, s), None,
        gdn_fwd._fake_state(torch.float32, s), gdn_fwd._fake_state(torch.float32, s),
        scalar(cutlass.Float32, 1.0), scalar(cutlass.Int32, 64), fake_stream())
digest(kernel, args, "fused")
