"""errands: durable background jobs for Python.

At-least-once delivery with leases, heartbeats, crash rescue and fenced completion;
payloads validated from type hints; classified failures with bounded retries; a real
dead-letter queue. Embedded SQLite by default.
"""

from __future__ import annotations

import logging

from .app import App
from .backends.base import SignalResult
from .context import Context
from .definition import BoundJob, JobDefinition
from .errors import (
    CancelIncomplete,
    ConfigurationError,
    DatabaseBusy,
    EnqueueUncertain,
    ErrandsError,
    InvalidPayload,
    InvalidTransition,
    JobCancelled,
    JobFailed,
    JobNotFound,
    ResultTimeout,
    SchemaOutdated,
    StepError,
    StorageFull,
    TransactionEnded,
    UnknownJob,
)
from .handle import JobHandle
from .interrupts import shielded
from .jobs import Job, JobError, JobState, Progress
from .outcomes import Permanent, Retry
from .retry import ExponentialBackoff
from .waiting import as_completed, await_all, wait_all
from .worker import collector as _collector  # noqa: F401  (reads gc thresholds at import)
from .workflows import (
    Batch,
    Edge,
    ParentResults,
    Workflow,
    WorkflowFailed,
    WorkflowHandle,
    WorkflowStatus,
    chain,
    chord,
    group,
    map_jobs,
)

__version__ = "0.1.0"

# A library logs; the application decides where logs go (the worker CLI configures them).
logging.getLogger("errands").addHandler(logging.NullHandler())

__all__ = [
    "App",
    "Batch",
    "BoundJob",
    "CancelIncomplete",
    "ConfigurationError",
    "Context",
    "DatabaseBusy",
    "Edge",
    "EnqueueUncertain",
    "ErrandsError",
    "ExponentialBackoff",
    "InvalidPayload",
    "InvalidTransition",
    "Job",
    "JobCancelled",
    "JobDefinition",
    "JobError",
    "JobFailed",
    "JobHandle",
    "JobNotFound",
    "JobState",
    "ParentResults",
    "Permanent",
    "Progress",
    "ResultTimeout",
    "Retry",
    "SchemaOutdated",
    "SignalResult",
    "StepError",
    "StorageFull",
    "TransactionEnded",
    "UnknownJob",
    "Workflow",
    "WorkflowFailed",
    "WorkflowHandle",
    "WorkflowStatus",
    "__version__",
    "as_completed",
    "await_all",
    "chain",
    "chord",
    "group",
    "map_jobs",
    "shielded",
    "wait_all",
]
