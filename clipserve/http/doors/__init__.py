"""The front doors, one module per API family: each bundles its routes, how it parses a request
into work and encodes the answer, and its error shape. A new protocol is a module here and an
entry in `DOORS`."""

from __future__ import annotations

from clipserve.http.door import FrontDoor
from clipserve.http.doors.aliases import AliasDoor
from clipserve.http.doors.kserve import KServeDoor
from clipserve.http.doors.native import NativeDoor
from clipserve.http.doors.openai import OpenAIDoor

DOORS: tuple[FrontDoor, ...] = (NativeDoor(), OpenAIDoor(), KServeDoor(), AliasDoor())
