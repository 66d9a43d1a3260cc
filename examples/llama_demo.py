"""Train a Llama-3-style transformer with tensor + sequence parallel ``local_map`` regions.

The model is ``localmap_fx.testing.llama.Llama``: grouped-query attention
with rotary embeddings and SwiGLU MLPs whose heads / hidden units are sharded
on the ``tp`` mesh dimension, sequence-parallel RMSNorms (activations
``Shard(1)`` between blocks), a vocabulary-parallel embedding, output
projection and cross-entropy.  With ``--dp N`` the mesh is ``("dp", "tp")``
and every parameter is also sharded on ``dp`` (gathered on region entry,
gradients reduce-scattered).  The script trains a few AdamW steps on random
tokens and checks the first step against single-device code.

One host, CPU, gloo (2 processes; 4 with ``--dp 2``)::

    torchrun --standalone --nproc-per-node 2 examples/llama_demo.py
    torchrun --standalone --nproc-per-node 4 examples/llama_demo.py --dp 2 --compile aot_eager

Several hosts with GPUs (NCCL; every rank uses ``cuda:$LOCAL_RANK``): run on
each of the ``NNODES`` hosts, with ``HOST0`` reachable from all of them::

    torchrun --nnodes $NNODES --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HOST0:29500 --rdzv-id llama-demo \\
        examples/llama_demo.py --dp $NNODES --layers 8 --dim 1024 --seq 512 --compile inductor

Options: ``--dtype bfloat16`` (bf16 parameters), ``--checkpoint full|selective``
(activation checkpointing of every block), ``--compile
none|aot_eager|inductor|inductor-inline`` (``inductor`` is
``backend="localmap_fx"``; ``inductor-inline`` keeps region bodies inline,
see docs/benchmarks.md for why both exist).
"""

from __future__ import annotations

import sys

from _model_demo import main, parser


def build(args, mesh, dtype, checkpoint):
    from localmap_fx.testing.llama import Llama, LlamaConfig

    heads = max(4, args.dim // 16)
    cfg = LlamaConfig(
        vocab=256, dim=args.dim, n_layers=args.layers, n_heads=heads, n_kv_heads=heads // 2,
        ffn_hidden=4 * args.dim, max_seq=max(args.seq, 32),
    )
    return Llama(cfg, mesh, checkpoint=checkpoint, dtype=dtype)


def reference(model, weights, tokens, targets):
    from localmap_fx.testing.llama import reference_loss

    return reference_loss(model.cfg, weights, tokens, targets)


if __name__ == "__main__":
    sys.exit(main(parser(__doc__.splitlines()[0]).parse_args(), "tp", build, reference, "llama"))
