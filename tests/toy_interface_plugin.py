"""Registers the toy interface where ``MEGASEMFACE_PLUGINS=toy_interface_plugin`` names it
(with tests/ on ``PYTHONPATH``): in a launched run's ranks and in each tool."""

from toy_interface import SPEC

from megasemface.interfaces.registry import register_interface

register_interface(SPEC)
