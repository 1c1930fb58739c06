"""On-disk format and commit protocol. Imports no other package of the project.

Modules: `manifest` (the JSON contract), `layout` (pure chunk planning), `zarr_meta`
(zarr v3 documents), `fsio` (durable writes), `commit` (version directories, lock,
prepare/publish), `chunk_read` (verified reads), `errors`.
"""
