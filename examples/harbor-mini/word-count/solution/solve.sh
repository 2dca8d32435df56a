#!/bin/bash
set -e
wc -w < poem.txt | tr -d ' ' > count.txt
