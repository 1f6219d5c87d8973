"""Horovod elastic training (`hvd.elastic`) is not reproduced by ddpdoctor's stand-in: a script that uses it fails
here with this explanation instead of an AttributeError."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(
        f"hvd.elastic.{name}: Horovod elastic training is not reproduced by ddpdoctor's Horovod stand-in "
        "(install Horovod to probe an elastic script)"
    )
