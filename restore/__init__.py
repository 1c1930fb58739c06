"""Finding, verifying and loading versions (tiers, discovery, reads)."""
