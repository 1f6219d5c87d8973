"""ddpdoctor's stand-in for Horovod (see ddpdoctor.probe.standins): only its PyTorch API, `horovod.torch`."""

# The API mirrored is Horovod 0.28's; the local version label says it is not Horovod itself.
__version__ = "0.28.1+ddpdoctor.standin"
