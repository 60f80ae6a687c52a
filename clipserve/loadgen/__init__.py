"""clipserve-bench: the load generator and the benchmark report (plots: `clipserve[bench]`).

`loadgen` drives one load point, `runner` wraps it with the server's /metrics and client
processes, `payloads` holds the wire formats, `output` the table/JSON/CSV/plots, `report` the
whole benchmark report.
"""
