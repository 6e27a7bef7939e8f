"""Plug-ins that live outside embodyhpc/, each in its own folder: they prove that a model or a suite is added
without editing any file of the project."""
