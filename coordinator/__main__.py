"""`python -m coordinator`: the coordinator service as itself (`stagecast coordinator` is the same command)."""

from stagecast.service import service_main

if __name__ == "__main__":
    service_main("coordinator")
