"""Version numbers of the plinth core and of the plugin API it speaks."""

__version__ = "0.1.0"

#: The plugin API version (major.minor). A plugin declares the version it was
#: built against; a different major is refused, a newer minor only warns.
PLUGIN_API_VERSION = "2.1"
