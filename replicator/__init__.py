"""Replication of committed versions to other disks and object storage, and retention.

Modules: `service` (the Replicator and its passes), `config`, `placement` (distinct
disks, disk identity), `transfer` (copying and verifying a version's files), `publish`
(committing them at a destination), `status` (what has been copied; the one
"fully replicated" rule), `gc` and `policy` (retention), `journal`, `ratelimit`,
`daemon` (`ckpt replicate`).
"""
