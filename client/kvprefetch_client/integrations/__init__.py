"""Plug-ins that report to kvprefetch from where events and signals already are: routers and
agent frameworks, each in a module of its own that needs its framework's extra of the light
client (`pip install 'kvprefetch-client[langchain]'`, ...). Import the module you use; this
package imports none of them."""
