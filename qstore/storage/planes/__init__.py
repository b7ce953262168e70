"""Where each table is written.

Each plane module is the only Python writer of its tables (the hot-path server functions
``claim_ready`` and ``complete_receipts`` write them too, inside the database):

* :mod:`~qstore.storage.planes.queue` — the queue ring (ready entries, tombstones, done
  entries, terminal count deltas), the deferred backlog and the DLQ, plus NOTIFY;
* :mod:`~qstore.storage.planes.execution` — leases, claim receipts and closures, attempt
  state: taking a live attempt out of running, heartbeats, callback tokens;
* :mod:`~qstore.storage.planes.control` — lanes, unique keys, queue options, claimer
  slots, the terminal counters, the backend registry;
* :mod:`~qstore.storage.planes.rings` — what rotation and pruning do to the rings as a
  whole: ring cursors (sequences), slot emptiness, exclusive locks and ``TRUNCATE``.

Operation families (:mod:`qstore.storage.enqueue`, :mod:`~qstore.storage.claim`, …) read
what they need and write only through these modules.
"""
