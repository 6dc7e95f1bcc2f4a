"""``stagecast.media`` is ``stagecast_client.media`` (clients/python, the client distribution): one module."""

import sys

import stagecast_client.media

sys.modules[__name__] = stagecast_client.media
