"""Several HTTP front-end processes feeding one engine process (`--workers N`, N > 1).

    supervisor ──spawns──▶ engine: the model, one Batcher per tower, the device workers
        │                    ▲ control channel (Unix socket, msgpack frames): admit, run,
        │                    │ release, cancel; replies; the engine's status, pushed
        └──spawns──▶ front ends (N): uvicorn + the same Pipeline; decode, then write each item
                     into a shared-memory slot; the engine reads items from the slots and writes
                     embeddings back into them

`slots.py` holds the shared memory, `wire.py` the frames, `messages.py` their types (and the
model card's and the status's), `service.py` the engine's side, `remote.py` the front end's,
`supervisor.py` the process tree. With `--workers 1` none of this runs: the one process holds
the Batchers itself, and the batching code is the same either way.
"""
