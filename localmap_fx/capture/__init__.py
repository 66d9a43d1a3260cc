"""Capture: how a ``local_map`` call becomes an annotated region under Dynamo.

- :mod:`.call`: the traced call (checks, redistribute, to_local, body, from_local).
- :mod:`.plan`: the common flat call planned in real Python at trace time.
- :mod:`.reuse`: Dynamo traces a repeated region body once.
- :mod:`.handoff`: the Dynamo-time slot through which comptime code hands values to the trace.
"""
