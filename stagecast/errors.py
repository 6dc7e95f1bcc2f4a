"""``stagecast.errors`` is ``stagecast_client.errors`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.errors

sys.modules[__name__] = stagecast_client.errors
