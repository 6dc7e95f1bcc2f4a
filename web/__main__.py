"""`python -m web`: the web service as itself (`stagecast web` is the same command)."""

from stagecast.service import service_main

if __name__ == "__main__":
    service_main("web")
