"""Ray seams: a logger of Ray Train's private execution context, its print-patch switch, and the
environment switch that keeps an embedded Ray on loopback. Written against ray 2.60.0 (pinned to 2.60.x in pyproject.toml);
tests/test_seams.py and tests/test_secure_defaults.py check their effect.

Nothing here imports Ray at module level: ``bind_embedded_ray_to_loopback`` must run before Ray is imported."""

from __future__ import annotations

import contextlib
import logging
import os


# ray 2.60.0: Ray Train V2's switch for its print patch, propagated from the driver to its workers: in
# a Ray worker the patch prints every line twice, once itself and once through the root logger's
# console handler. An internal variable (``ray.train.v2._internal.constants``); if Ray renames it, each
# worker line is printed twice again outside verbose mode, nothing breaks.
NO_TRAIN_PRINT_PATCH = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def quiet_train_report_logger() -> None:
    """No "Reporting training result" line from Ray Train for every ``ray.train.report``.

    ray 2.60.0: that line is logged by a logger named after the file of the private module
    ``ray.train.v2._internal.execution.context`` (so the run's ``LoggingConfig`` level does not reach
    it); this sets it to WARNING. If the module moves, nothing happens (the line comes back on
    every report, nothing breaks)."""
    with contextlib.suppress(Exception):
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def bind_embedded_ray_to_loopback(address: str | None) -> None:
    """Where this process will start an embedded Ray, make its node listen on 127.0.0.1 only.

    A local run needs no port reachable from the network, and Ray's ports run code for whoever reaches
    them. Ray 2.60 binds its GCS, raylet and workers to the node's IP, found from the network unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off (Ray's switch for single-machine platforms), which
    Ray reads when it is imported: so this runs before anything imports ray, and its child processes
    inherit it. Joining a cluster (``--address``, ``RAY_ADDRESS``) leaves the environment as it is.
    If Ray drops the switch, the embedded node listens on the machine's address again
    (tests/test_secure_defaults.py fails).
    """
    if not (address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
