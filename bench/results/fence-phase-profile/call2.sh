#!/bin/bash
# FENCE phase profile (profiling build of base) at 1, 16, 64, 128 tokens.
R=/tmp/r; mkdir -p $R; S=$(cd "$(dirname "$0")" && pwd); AB=$(cd $S/.. && pwd)
export PYTHONUNBUFFERED=1
cd $AB/prof && PYTHONPATH=$AB/prof:$AB/notorch timeout 300 python3 $S/fprof.py 1,16,64,128 > $R/fprof.log 2>&1
echo "rc=$?"
cp $R/fprof.log $OUT/
cat $R/fprof.log | grep -v "^\[" | tail -80
