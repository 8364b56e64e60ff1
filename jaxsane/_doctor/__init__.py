"""_doctor: see the package map in jaxsane/__init__.py."""
