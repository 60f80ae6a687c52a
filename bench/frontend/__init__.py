"""Front ends (`--workers N`, issue 8): what the HTTP side costs, whether batching and throughput
hold up across front-end processes, and whether CPU serving regressed. One JSON, five sections,
each in interleaved rounds (this machine is shared and noisy) with medians and spread:

  cost        CPU-seconds of every server process (psutil over the tree) per request at
              saturation, for single-image raw uint8 tensors (224x224x3) and 640x480 JPEGs, beside
              a bare-Starlette floor (bench/frontend/floor.py) and the same floor with
              clipserve's heap settings (floor-kept: glibc's otherwise sometimes faults in every
              body's pages, twice the CPU) in the same rounds, page faults counted; fake backend
              with compute=0, so the fake's own work is O(1) per image. JPEG decode is measured
              offline (per round, on the server's cores) and reported as its own share. Server
              pinned to the first cores, the load generator (wrk, else clipserve-bench's aiohttp
              client) to the last; /readyz answers once one front end is up, so load waits until
              all N listen. --cost-before-tree adds a one-process checkout (its fake must know
              compute=0). --cost-bare adds the floor's answer from a bare httptools protocol
              (bench/frontend/bare.py): what HTTP itself costs, below uvicorn; --cost-direct
              clipserve's /embed endpoint under it (bench/frontend/direct.py). A py-spy profile
              (py-spy starts the server: here it may trace only its own descendants) says where
              each variant's time goes, per process and thread.
              Points with over 1% failed requests stay in the rows, out of the summaries.
  batching    mean batch size (/metrics clipserve_batch_size) at a fixed open-loop rate with a
              20 ms fake batch, N front ends against one: target within 10%.
  scaling     saturated requests/s of tensor requests with each of --workers-list front ends
              (servers w1, w2, ...; with --scaling-reuse-port also w2r, ...: --reuse-port).
  regression  served images/s at concurrency 32, tiny real model on CPU, JPEGs, --workers 1,
              against --before-tree (a checkout of the commit before issue 8), and the server
              tree's CPU per image (steadier than img/s on a shared machine). Runs with policy.
  policy      the same load: batch-size histogram, img/s and p99 for the before tree and for
              --max-queue-delay-ms in --delays.

    python -m bench.frontend --quick                        # every section, one short round
    git worktree add --detach /tmp/clipserve-before 70dba1d
    python -m bench.frontend --before-tree /tmp/clipserve-before
    python -m bench.frontend --sections scaling --workers-list 1,2,4,8,14 --client-cores 2 \
        --scaling-reuse-port                                # a 16-core host, no GPU needed
"""
