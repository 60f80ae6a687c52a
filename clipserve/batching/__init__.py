from clipserve.batching.batcher import Batcher, Completed
from clipserve.batching.queue import Admission, BatchQueue, Ticket, WorkItem

__all__ = ["Admission", "BatchQueue", "Batcher", "Completed", "Ticket", "WorkItem"]
