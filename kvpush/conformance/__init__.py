"""Backend conformance suite: what every kvpush backend must do, as tests any backend can run.

``kvpush conformance --backend NAME`` (``cli``) runs the packaged pytest suite
(``suite/``) through the ``kvpush_conformance`` pytest plugin (``plugin``)
against one backend, found by entry point or as ``module:Class``
(``target``). In-process tests check the backend alone; two worker processes
(``worker``) push through real NIXL agents, and the result is compared with an
independent model of the cache's logical bytes (``model``). Backends take part
through the optional test-support surface of ``kvpush.backends.base.Backend``;
docs/backends.md explains both.
"""
