"""Engines that sample with tokensampler through their own extension points."""
