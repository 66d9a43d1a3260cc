"""Compiling a repeated layer once: layer sharing, one module per job.

A model that repeats one layer N times reaches the backend as one flat
Dynamo graph.  This package finds the repeats, decides whether to share
them, and cuts the graph into *pieces* so that each distinct layer is
compiled once and called per layer::

    before (one graph)                          after (outer graph + pieces)
    ------------------                          ----------------------------
    x, w0, w1, w2 = inputs                      x, w0, w1, w2 = inputs
    a0 = to_local(x); ... h0 = redistribute()   (h0,) = piece_layer_0(x, w0)      # key K
    a1 = to_local(h0); ... h1 = redistribute()  (h1,) = piece_layer_1(h0, w1)     # key K: same compiled code
    a2 = to_local(h1); ... h2 = redistribute()  (h2,) = piece_layer_2(h1, w2)     # key K
    loss = (h2 * h2).sum()                      (loss,) = piece_tail(h2)

In the order the pipeline (:mod:`localmap_fx.compiler.pipeline`) uses them:

    plan.py      LayerSpan / LayerPlan: which nodes form which layer (values)
    find.py      find_layer_spans: period search, keys, weight hoisting, cuts
    decide.py    decide(): share or keep one graph, with a Reason code; the
                 cost model (LayerCost, PIECE_OVERHEAD_S)
    borders.py   plain borders: Replicate DTensors cross as local tensors (a pass)
    split.py     split_layers: the outer graph of pieces (a pass), PieceMeta
    piece_meshes.py  lift_piece_meshes: a layer piece's meshes become constants (a pass)
    whole_gradients.py  the last layer's gradient arrives whole: the tail keeps
                 it, the layer's run supplies its backward's reduction (a pass)
    compile.py   compile_pieces: each piece once per key -> CompiledPiece
    runtime.py   CompiledLayer (or a Refusal), LayerRun: a run of layers as
                 one autograd.Function
    runs.py      chain_layer_runs: consecutive layer calls -> one LayerRun (a pass)
    unwrap.py    Unwrap: a piece that only unwraps DTensors, run without a compile

The package's ``__init__`` imports none of them.
"""
