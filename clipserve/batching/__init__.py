from clipserve.batching.batcher import Batcher
from clipserve.batching.queue import Admission, BatchQueue, Ticket, WorkItem
from clipserve.batching.tower import Completed, TowerKind

__all__ = ["Admission", "BatchQueue", "Batcher", "Completed", "Ticket", "TowerKind", "WorkItem"]
