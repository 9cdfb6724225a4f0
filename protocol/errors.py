"""Errors raised while decoding what arrives from the network."""


class ProtocolError(ValueError):
    """A message does not follow Stoker wire protocol v1.

    The text names what was wrong (field, expected and actual value). Receivers
    catch it, count it and carry on with the next message; nothing else is lost.
    """
