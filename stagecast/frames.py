"""``stagecast.frames`` is ``stagecast_client.frames`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.frames

sys.modules[__name__] = stagecast_client.frames
