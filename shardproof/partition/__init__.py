"""Scale: trace and prove each structurally distinct layer once, reuse it for its copies.

`fingerprint` says when two module calls are interchangeable; `module_calls` traces the first
call of each kind and turns its copies into `call` nodes of the IR; `templates` holds the traced
graph of a call and expands calls back into plain ops where a consumer needs them.
"""
