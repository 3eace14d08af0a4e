"""miles-training-utils: the algorithm core every miles training backend trains through.

Example::

    from miles.backends.training_utils.device import get_device_info

    info = get_device_info()
    print(info.kind, info.dist_backend)  # e.g. "cpu gloo"
"""

from miles.backends.training_utils.device import DeviceInfo, get_device_info

__all__ = ["DeviceInfo", "get_device_info"]
