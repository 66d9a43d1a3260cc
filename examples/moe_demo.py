"""Train a DeepSeek-V3-style mixture of experts with expert-parallel ``local_map`` regions.

The model is ``localmap_fx.testing.moe.MoE``: a sigmoid top-k router with
an (aux-loss-free) balancing bias, dropless token dispatch and combine with
``all_to_all`` inside the MoE region (experts sharded on the ``ep`` mesh
dimension, run as batched "grouped" matmuls), a shared expert, and the
sequence-wise balance loss and per-expert token counts returned by the region
next to its output.  With ``--dp N`` the mesh is ``("dp", "ep")`` and every
parameter is also sharded on ``dp``.  ``--dispatch all_gather`` exchanges
tokens with all_gather + reduce_scatter instead (for groups without
all_to_all).  The script trains a few AdamW steps on random tokens and checks
the first step against single-device code.

One host, CPU, gloo (2 processes; 4 with ``--dp 2``)::

    torchrun --standalone --nproc-per-node 2 examples/moe_demo.py
    torchrun --standalone --nproc-per-node 4 examples/moe_demo.py --dp 2 --compile aot_eager

Several hosts with GPUs (NCCL; every rank uses ``cuda:$LOCAL_RANK``): run on
each of the ``NNODES`` hosts, with ``HOST0`` reachable from all of them::

    torchrun --nnodes $NNODES --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HOST0:29500 --rdzv-id moe-demo \\
        examples/moe_demo.py --dp $NNODES --experts 64 --dim 1024 --seq 512 --compile inductor

Options as in ``llama_demo.py``, plus ``--experts``, ``--top-k`` and ``--dispatch``.
"""

from __future__ import annotations

import sys

from _model_demo import main, parser


def build(args, mesh, dtype, checkpoint):
    from localmap_fx.testing.moe import MoE, MoEConfig

    cfg = MoEConfig(
        vocab=256, dim=args.dim, n_layers=args.layers, n_experts=args.experts, top_k=args.top_k,
        moe_hidden=args.dim, shared_hidden=args.dim,
    )
    return MoE(cfg, mesh, checkpoint=checkpoint, dtype=dtype, dispatch=args.dispatch)


def reference(model, weights, tokens, targets):
    from localmap_fx.testing.moe import reference_loss

    lay = model.layout
    return reference_loss(model.cfg, weights, tokens, targets, lay.dp_size, lay.model_size)


if __name__ == "__main__":
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dispatch", choices=["all_to_all", "all_gather"], default="all_to_all")
    sys.exit(main(p.parse_args(), "ep", build, reference, "moe"))
