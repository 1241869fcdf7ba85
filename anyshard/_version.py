"""The version of anyshard, recorded in every manifest it writes."""

__version__ = "0.1.0"
