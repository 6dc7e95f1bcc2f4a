"""The top floor: the ``stagecast`` console script, the process launcher, ``up``, selftest and the demo.

It may import every service; nothing below it imports it.
"""
