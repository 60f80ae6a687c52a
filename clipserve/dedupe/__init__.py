"""`clipserve dedupe`: find exact and near-duplicate photos in folders with CLIP embeddings.

scan (walk, hash, header check) → cache (manifest and embeddings that survive runs) → embed
(one file per content hash, through clipserve.client) → index (pairs over a threshold) →
group (exact by hash, near by union-find) → report (groups.json, groups.csv, report.html).
"""
