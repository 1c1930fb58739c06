"""Replication of committed versions to other disks and object storage."""
